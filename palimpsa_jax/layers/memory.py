"""The recurrent memories behind the mixers: thin wrappers over `palimpsa_jax.kernels` that own
the memory's state convention (for the decoding cache) and, for the Bayesian memory, its prior.

All take q, k (B, T, H, Dk), v (B, T, H, Dv), log_alpha (B, T, H) and return
(o (B, T, H, Dv) in v's dtype, final state or None). A state is returned only when one is
passed in, i.e. when decoding from a cache. Three helpers do the rest: `kernel_options` picks
the backend for a call, `run_kernel` runs a kernel per (batch, heads) shard under an active mesh,
and `record` sows a call's kernel inputs when the memory is probed
(`palimpsa_jax.analysis.probe`, the training diagnostics).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax import kernels
from palimpsa_jax.kernels import Posterior
from palimpsa_jax.layers import registry
from palimpsa_jax.layers.init import Constant, initializers, linear, param, uniform
from palimpsa_jax.sharding import per_shard

Array = jax.Array
PRIOR_FAMILIES = ("head", "row", "synapse")
STATE_NAMES = ("batch", "heads", None, None)   # a (B, H, Dv, Dk) state matrix


def kernel_options(backend: str, chunk_size: int | None, length: int) -> dict:
    """Kernel backend options for a call of `length` tokens (the sequential reference for T=1)."""
    if length == 1 or backend == "reference":
        return {"backend": "reference"}
    return {"backend": backend, "chunk_size": chunk_size}


def run_kernel(kernel, arrays: tuple, *, options: dict, prior=None, state=None,
               segment_ids=None, scale=None, return_final_state: bool = False,
               return_variance: bool = False) -> kernels.AttentionOutput:
    """kernel(*arrays, [prior,] scale=, initial_state=state, segment_ids=, ...) as an
    AttentionOutput, per (batch, heads) shard when `palimpsa_jax.sharding.use_mesh` is active.

    arrays: the kernel's (B, T, H, ...) positional arguments; prior (H, ...) follows them.
    The final state is computed when asked for or when a state is passed in.
    """
    return_final_state = return_final_state or state is not None
    args = arrays if prior is None else (*arrays, prior)
    names = tuple(("batch", None, "heads") + (None,) * (x.ndim - 3) for x in arrays)
    if prior is not None:
        names += (("heads",) + (None,) * (prior.ndim - 1),)
    token_names = ("batch", None, "heads", None)
    state_names = STATE_NAMES                              # a prefix of any state pytree

    extra = {"return_variance": True} if return_variance else {}   # Palimpsa's option only

    def run(args, state, segment_ids):
        out = kernel(*args, scale=scale, initial_state=state, segment_ids=segment_ids,
                     return_final_state=return_final_state, **extra, **options)
        return out if isinstance(out, kernels.AttentionOutput) else kernels.AttentionOutput(out)

    out_names = kernels.AttentionOutput(token_names, state_names if return_final_state else None,
                                        token_names if return_variance else None)
    in_names = (names, None if state is None else state_names,
                None if segment_ids is None else ("batch", None))
    return per_shard(run, in_names, out_names)(args, state, segment_ids)


def record(memory: nnx.Module, *, scale, segment_ids, **inputs) -> None:
    """When `memory.probe` is set, sows the kernel inputs of this call as nnx.Intermediate
    "kernel_inputs": a dict of arrays q, k, v, log_alpha (and beta, prior for the Bayesian
    memory), the read-out scale (a float32 scalar; None means Dk^-1/2) and the segment ids
    (omitted when None), from which `palimpsa_jax.analysis` computes everything it reports."""
    if memory.probe:
        scale = inputs["q"].shape[-1] ** -0.5 if scale is None else scale
        extra = {} if segment_ids is None else {"segment_ids": segment_ids}
        memory.sow(nnx.Intermediate, "kernel_inputs",
                   {**inputs, "scale": jnp.float32(scale), **extra})


class Prior(nnx.Module):
    """The prior precision I_prior = exp(Ip_log) of a Bayesian memory.

    family "head": one per head, (H,); "row": one per value row, (H, Dv); "synapse": one per
    state element, (H, Dv, Dk). Ip_log starts at 0 (I_prior = 1); learned (an nnx.Param, no
    weight decay) if `learn`, else a fixed Constant.
    """

    def __init__(self, num_heads: int, dv: int, dk: int, *, family: str = "head",
                 learn: bool = False, rngs: nnx.Rngs):
        if family not in PRIOR_FAMILIES:
            raise ValueError(f"prior_family must be one of {PRIOR_FAMILIES}, got {family!r}")
        shape = {"head": (num_heads,), "row": (num_heads, dv), "synapse": (num_heads, dv, dk)}
        names = ("heads",) + (None,) * (len(shape[family]) - 1)
        self.family = family
        self.Ip_log = param(initializers.zeros_init(), shape[family], names, rngs,
                            weight_decay=False, variable=nnx.Param if learn else Constant)

    def __call__(self) -> Array:
        """I_prior, float32, of the family's shape."""
        return jnp.exp(self.Ip_log[...])


class Memory(nnx.Module):
    """What every memory has: a kernel backend and chunk size, the `probe` flag of `record`,
    and a zero (B, H, Dv, Dk) float32 initial state."""

    def __init__(self, *, backend: str = "auto", chunk_size: int | None = None):
        self.backend, self.chunk_size = backend, chunk_size
        self.probe = False

    def initial_state(self, batch: int, heads: int, dk: int, dv: int):
        return jnp.zeros((batch, heads, dv, dk), jnp.float32)

    def options(self, length: int) -> dict:
        return kernel_options(self.backend, self.chunk_size, length)


class LinearMemory(Memory):
    """Non-metaplastic memory (Mamba2 / simple GLA): S_t = alpha_t S_{t-1} + v_t ⊗ k_t,
    o_t = scale S_t q_t, divided by I_prior when a `Prior` of family "head" or "row" is given
    (the non-metaplastic Palimpsa baseline). State S (B, H, Dv, Dk) float32."""

    def __init__(self, *, prior: Prior | None = None, backend: str = "auto",
                 chunk_size: int | None = None):
        if prior is not None and prior.family == "synapse":
            raise ValueError("prior_family 'synapse' needs metaplasticity: without it the "
                             "read-out S q / I_prior divides each output row by one prior")
        super().__init__(backend=backend, chunk_size=chunk_size)
        self.prior = prior

    def __call__(self, q, k, v, log_alpha, *, scale=None, state=None, segment_ids=None):
        record(self, q=q, k=k, v=v, log_alpha=log_alpha, scale=scale, segment_ids=segment_ids)
        out = run_kernel(kernels.gla_attention, (q, k, v, log_alpha), state=state,
                         segment_ids=segment_ids, scale=scale, options=self.options(q.shape[1]))
        o = out.o
        if self.prior is not None:
            prior = self.prior()
            o = (o / (prior[:, None] if prior.ndim == 1 else prior)).astype(v.dtype)
        return o, out.final_state


class DeltaMemory(Memory):
    """Gated delta rule S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ,
    o_t = scale S_t q_t, with scalar beta (B, T, H). State S (B, H, Dv, Dk) float32."""

    def __call__(self, q, k, v, beta, log_alpha, *, scale=None, state=None, segment_ids=None):
        record(self, q=q, k=k, v=v, beta=beta, log_alpha=log_alpha, scale=scale,
               segment_ids=segment_ids)
        out = run_kernel(kernels.gated_delta_attention, (q, k, v, beta, log_alpha), state=state,
                         segment_ids=segment_ids, scale=scale, options=self.options(q.shape[1]))
        return out.o, out.final_state


class PalimpsaMemory(Memory):
    """Metaplastic memory (arXiv 2602.09075): a diagonal Gaussian posterior (mu, I) over S with
    I_t = alpha_t I_{t-1} + (1 - alpha_t) I_prior + beta_t ⊗ k_t², read out through its mean.
    beta (B, T, H, Dv) comes from the mixer; the prior is this memory's `Prior`.
    State `Posterior` (mu, I), each (B, H, Dv, Dk) float32."""

    def __init__(self, *, prior: Prior, backend: str = "auto", chunk_size: int | None = None):
        super().__init__(backend=backend, chunk_size=chunk_size)
        self.prior = prior

    def initial_state(self, batch: int, heads: int, dk: int, dv: int) -> Posterior:
        prior = self.prior()
        prior = prior.reshape(prior.shape + (1,) * (3 - prior.ndim))
        importance = jnp.broadcast_to(prior, (batch, heads, dv, dk))
        return Posterior(jnp.zeros((batch, heads, dv, dk), jnp.float32), importance)

    def __call__(self, q, k, v, beta, log_alpha, *, scale=None, state=None, segment_ids=None):
        prior = self.prior()
        record(self, q=q, k=k, v=v, beta=beta, log_alpha=log_alpha, prior=prior, scale=scale,
               segment_ids=segment_ids)
        out = run_kernel(kernels.palimpsa_attention, (q, k, v, beta, log_alpha), prior=prior,
                         state=state, segment_ids=segment_ids, scale=scale,
                         options=self.options(q.shape[1]))
        return out.o, out.final_state


class BetaProjection(nnx.Module):
    """The input precision of the Bayesian memory (arXiv 2602.09075, Palimpsa-D and -M):
    beta = sigmoid(W_b2 W_b1 x) softplus(b_scale[h]) input_gate, (B, T, H, Dv) float32.

    W_b1 (d_model -> rank) is N(0, std²), W_b2 (rank -> H Dv) uniform in ±rank^-1/2, b_scale
    starts at 1 (softplus(1) ≈ 1.31) and is not weight-decayed.
    """

    def __init__(self, d_model: int, num_heads: int, dv: int, *, rank: int, std: float,
                 dtype=None, rngs: nnx.Rngs):
        self.num_heads, self.dv = num_heads, dv
        self.W_b1 = linear(d_model, rank, ("embed", "rank"), rngs, std=std, dtype=dtype)
        self.W_b2 = linear(rank, num_heads * dv, ("rank", "heads"), rngs, std=std,
                           kernel_init=uniform(rank**-0.5), dtype=dtype)
        self.b_scale = param(initializers.ones_init(), (num_heads,), ("heads",), rngs,
                             weight_decay=False)

    def __call__(self, x, input_gate):
        """x (B, T, d_model), input_gate (B, T, H) >= 0 -> beta (B, T, H, Dv) float32."""
        batch, length, _ = x.shape
        gate = jax.nn.sigmoid(self.W_b2(self.W_b1(x)).astype(jnp.float32))
        return (gate.reshape(batch, length, self.num_heads, self.dv)
                * jax.nn.softplus(self.b_scale[...])[:, None] * input_gate[..., None])


registry.register_beta_rule("low_rank", BetaProjection)


def palimpsa_memory(d_model: int, num_heads: int, dv: int, dk: int, *, metaplasticity: bool,
                    beta_rank: int, prior_family: str, learn_prior: bool, std: float,
                    backend: str, chunk_size: int | None, dtype, rngs: nnx.Rngs,
                    beta_rule: str = "low_rank"):
    """The memory of a Palimpsa mixer and its beta projection (None without metaplasticity):
    (the beta rule's module, PalimpsaMemory) or (None, LinearMemory over the prior). beta_rule:
    a name of `layers.registry` ("low_rank": BetaProjection) or "module:attribute"."""
    prior = Prior(num_heads, dv, dk, family=prior_family, learn=learn_prior, rngs=rngs)
    if not metaplasticity:
        return None, LinearMemory(prior=prior, backend=backend, chunk_size=chunk_size)
    factory = registry.resolve(registry.BETA_RULES, "beta_rule", beta_rule)
    beta = factory(d_model, num_heads, dv, rank=beta_rank, std=std, dtype=dtype, rngs=rngs)
    return beta, PalimpsaMemory(prior=prior, backend=backend, chunk_size=chunk_size)


def remember(beta: BetaProjection | None, memory, q, k, v, log_alpha, *, hidden, input_gate,
             scale=None, state=None, segment_ids=None):
    """Runs the memory of `palimpsa_memory`: with a beta projection, the Bayesian memory with
    beta = beta(hidden, input_gate); without, the linear memory over the prior."""
    if beta is None:
        return memory(q, k, v, log_alpha, scale=scale, state=state, segment_ids=segment_ids)
    return memory(q, k, v, beta(hidden, input_gate).astype(q.dtype), log_alpha, scale=scale,
                  state=state, segment_ids=segment_ids)
