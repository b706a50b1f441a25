"""The recurrent memories behind the mixers: thin wrappers over `kernels` that own the memory's
own parameters (beta, prior) and its state convention for the decoding cache.

All take q, k (B, T, H, Dk), v (B, T, H, Dv), log_alpha (B, T, H) and return
(o (B, T, H, Dv) in v's dtype, final state or None). A state is asked for (and returned) only
when one is passed in, i.e. when decoding from a cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from palimpsa_jax.layers.common import Array, Constant, init, linear, param
from palimpsa_jax.sharding import per_shard


def kernel_options(backend: str, chunk_size: int | None, length: int) -> dict:
    """Kernel backend options for a call of `length` tokens (the sequential reference for T=1)."""
    if length == 1 or backend == "reference":
        return {"backend": "reference"}
    return {"backend": backend, "chunk_size": chunk_size}


def _token_names(x: Array) -> tuple:
    """Logical axes of a kernel argument: (B, T, H, ...) arrays, or the per-head prior (H,)."""
    return ("heads",) if x.ndim == 1 else ("batch", None, "heads") + (None,) * (x.ndim - 3)


STATE_NAMES = ("batch", "heads", None, None)   # a (B, H, Dv, Dk) state matrix


class KernelMemory(nnx.Module):
    """A memory computed by one of `kernels`, with a zero (B, H, Dv, Dk) float32 initial state.

    Under `palimpsa_jax.sharding.use_mesh` the kernel runs per (batch, heads) shard.
    With `diagnose=True` (set by `palimpsa_jax.training.diagnostics`) a call also sows, per head,
    the mean memory window N = 1 / (1 - alpha) over its tokens (`memory_window`, (H,)).
    """
    state_matrices = 1   # matrices in the state: S, or (mu, I) for the metaplastic memory

    def __init__(self, *, backend: str = "auto", chunk_size: int | None = None):
        self.backend, self.chunk_size = backend, chunk_size
        self.diagnose = False

    def initial_state(self, batch: int, heads: int, dk: int, dv: int):
        return jnp.zeros((batch, heads, dv, dk), jnp.float32)

    def _run(self, kernel, *arrays, log_alpha, scale=None, state=None, segment_ids=None,
             final_state=False):
        """kernel(*arrays, ...) -> (o, final state or None); arrays are the kernel's positional
        arguments (log_alpha among them, also given by name for the diagnostics). The final
        state is returned when a state is passed in or final_state is True."""
        if self.diagnose:
            window = 1.0 / -jnp.expm1(log_alpha.astype(jnp.float32))
            self.sow(nnx.Intermediate, "memory_window", jnp.mean(window, axis=(0, 1)))
        final_state = final_state or state is not None
        options = kernel_options(self.backend, self.chunk_size, arrays[0].shape[1])

        def run(arrays, state, segment_ids):
            return kernel(*arrays, scale=scale, initial_state=state, segment_ids=segment_ids,
                          return_final_state=final_state, **options)

        state_names = STATE_NAMES if self.state_matrices == 1 else (STATE_NAMES,) * self.state_matrices
        in_names = (tuple(map(_token_names, arrays)), None if state is None else state_names,
                    None if segment_ids is None else ("batch", None))
        o_names = _token_names(arrays[2])
        out = per_shard(run, in_names, (o_names, state_names) if final_state else o_names
                        )(arrays, state, segment_ids)
        return out if final_state else (out, None)


class LinearMemory(KernelMemory):
    """Non-metaplastic memory (Mamba2 / simple GLA): S_t = alpha_t S_{t-1} + v_t ⊗ k_t,
    o_t = scale S_t q_t. State S (B, H, Dv, Dk) float32. No parameters."""

    def __call__(self, q, k, v, log_alpha, *, hidden, input_gate, scale=None, state=None,
                 segment_ids=None):
        """hidden (B, T, d_model) and input_gate (B, T, H) are unused here (see PalimpsaMemory)."""
        return self._run(kernels.gla_attention, q, k, v, log_alpha, log_alpha=log_alpha,
                         scale=scale, state=state, segment_ids=segment_ids)


class DeltaMemory(KernelMemory):
    """Gated delta rule S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ,
    o_t = scale S_t q_t, with scalar beta (B, T, H). State S (B, H, Dv, Dk) float32."""

    def __call__(self, q, k, v, beta, log_alpha, *, state=None, segment_ids=None):
        return self._run(kernels.gated_delta_attention, q, k, v, beta, log_alpha,
                         log_alpha=log_alpha, state=state, segment_ids=segment_ids)


class PalimpsaMemory(LinearMemory):
    """Metaplastic memory (SPEC sections 1 and 3) with its parameters.

    beta = sigmoid(W_b2 W_b1 hidden) * softplus(b_scale[h]) * input_gate  (B, T, H, Dv);
    prior I_prior = exp(Ip_log[h]) (a Param if learn_prior, else a fixed Constant).
    State (mu, I), each (B, H, Dv, Dk) float32. With metaplasticity=False there are no beta
    parameters and the read-out is the linear memory over the prior, o = scale S q / I_prior,
    on the fast `gla_attention` path.
    """

    def __init__(self, d_model: int, num_heads: int, dv: int, *, beta_rank: int,
                 metaplasticity: bool = True, learn_prior: bool = False, backend: str = "auto",
                 chunk_size: int | None = None, dtype=None, rngs: nnx.Rngs):
        super().__init__(backend=backend, chunk_size=chunk_size)
        self.metaplasticity, self.num_heads, self.dv = metaplasticity, num_heads, dv
        if metaplasticity:
            self.W_b1 = linear(d_model, beta_rank, ("embed", "rank"), rngs, dtype=dtype)
            self.W_b2 = linear(beta_rank, num_heads * dv, ("rank", "heads"), rngs, dtype=dtype)
            self.b_scale = param(init.ones_init(), (num_heads,), ("heads",), rngs, weight_decay=False)
        self.Ip_log = param(init.zeros_init(), (num_heads,), ("heads",), rngs, weight_decay=False,
                            variable=nnx.Param if learn_prior else Constant)

    @property
    def state_matrices(self) -> int:
        return 2 if self.metaplasticity else 1

    @property
    def prior(self) -> Array:
        """I_prior (H,) float32."""
        return jnp.exp(self.Ip_log[...])

    def initial_state(self, batch: int, heads: int, dk: int, dv: int):
        if not self.metaplasticity:
            return super().initial_state(batch, heads, dk, dv)
        importance = jnp.broadcast_to(self.prior[:, None, None], (batch, heads, dv, dk))
        return jnp.zeros((batch, heads, dv, dk), jnp.float32), importance

    def __call__(self, q, k, v, log_alpha, *, hidden, input_gate, scale=None, state=None,
                 segment_ids=None):
        """hidden: (B, T, d_model) input of the beta projection; input_gate: (B, T, H) >= 0."""
        prior = self.prior
        if not self.metaplasticity:
            o, state = super().__call__(q, k, v, log_alpha, hidden=hidden, input_gate=input_gate,
                                        scale=scale, state=state, segment_ids=segment_ids)
            return (o / prior[:, None]).astype(v.dtype), state
        batch, length = q.shape[:2]
        gate = jax.nn.sigmoid(self.W_b2(self.W_b1(hidden)).astype(jnp.float32))
        beta = (gate.reshape(batch, length, self.num_heads, self.dv)
                * jax.nn.softplus(self.b_scale[...])[:, None] * input_gate[..., None])
        o, final = self._run(kernels.palimpsa_attention, q, k, v, beta.astype(q.dtype), log_alpha,
                             prior, log_alpha=log_alpha, scale=scale, state=state,
                             segment_ids=segment_ids, final_state=self.diagnose)
        if self.diagnose:
            importance = final[1]
            self.sow(nnx.Intermediate, "importance_mean", jnp.mean(importance, axis=(0, 2, 3)))
            self.sow(nnx.Intermediate, "importance_min", jnp.min(importance, axis=(0, 2, 3)))
            self.sow(nnx.Intermediate, "importance_max", jnp.max(importance, axis=(0, 2, 3)))
        return o, final if state is not None else None
