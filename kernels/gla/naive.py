"""Sequential reference of the non-metaplastic recurrence (Mamba2 / simple GLA).

    S_t = alpha_t S_{t-1} + v_t ⊗ k_t,    o_t = scale S_t q_t,    S: (B, H, Dv, Dk) float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking


def gla_reference(q, k, v, log_alpha, S0, reset, *, scale: float):
    """q, k: (B, T, H, Dk); v: (B, T, H, Dv); log_alpha: (B, T, H) float32; S0: (B, H, Dv, Dk);
    reset: (B, T, H) bool. Returns o (B, T, H, Dv) float32 and S_T."""
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

    def step(S, token):
        q_t, k_t, v_t, alpha_t = token
        S = alpha_t[..., None, None] * S + v_t[..., :, None] * k_t[..., None, :]
        return S, scale * jnp.sum(S * q_t[..., None, :], axis=-1)

    alpha = jnp.moveaxis(chunking.gates(log_alpha, reset), 1, 0)
    S, o = jax.lax.scan(step, S0, (f32(q), f32(k), f32(v), alpha))
    return jnp.moveaxis(o, 0, 1), S
