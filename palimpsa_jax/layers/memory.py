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


def kernel_options(backend: str, chunk_size: int | None, length: int) -> dict:
    """Kernel backend options for a call of `length` tokens (the sequential reference for T=1)."""
    if length == 1 or backend == "reference":
        return {"backend": "reference"}
    return {"backend": backend, "chunk_size": chunk_size}


class KernelMemory(nnx.Module):
    """A memory computed by one of `kernels`, with a zero (B, H, Dv, Dk) float32 initial state."""

    def __init__(self, *, backend: str = "auto", chunk_size: int | None = None):
        self.backend, self.chunk_size = backend, chunk_size

    def initial_state(self, batch: int, heads: int, dk: int, dv: int):
        return jnp.zeros((batch, heads, dv, dk), jnp.float32)

    def _run(self, kernel, q, *args, scale=None, state=None, segment_ids=None):
        """kernel(q, *args, ...) -> (o, final state or None)."""
        out = kernel(q, *args, scale=scale, initial_state=state, segment_ids=segment_ids,
                     return_final_state=state is not None,
                     **kernel_options(self.backend, self.chunk_size, q.shape[1]))
        return out if state is not None else (out, None)


class LinearMemory(KernelMemory):
    """Non-metaplastic memory (Mamba2 / simple GLA): S_t = alpha_t S_{t-1} + v_t ⊗ k_t,
    o_t = scale S_t q_t. State S (B, H, Dv, Dk) float32. No parameters."""

    def __call__(self, q, k, v, log_alpha, *, hidden, input_gate, scale=None, state=None,
                 segment_ids=None):
        """hidden (B, T, d_model) and input_gate (B, T, H) are unused here (see PalimpsaMemory)."""
        return self._run(kernels.gla_attention, q, k, v, log_alpha, scale=scale, state=state,
                         segment_ids=segment_ids)


class DeltaMemory(KernelMemory):
    """Gated delta rule S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ,
    o_t = scale S_t q_t, with scalar beta (B, T, H). State S (B, H, Dv, Dk) float32."""

    def __call__(self, q, k, v, beta, log_alpha, *, state=None, segment_ids=None):
        return self._run(kernels.gated_delta_attention, q, k, v, beta, log_alpha, state=state,
                         segment_ids=segment_ids)


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
        return self._run(kernels.palimpsa_attention, q, k, v, beta.astype(q.dtype), log_alpha,
                         prior, scale=scale, state=state, segment_ids=segment_ids)
