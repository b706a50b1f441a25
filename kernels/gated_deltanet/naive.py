"""Sequential reference of the gated delta rule (Gated DeltaNet, README "The unified view").

    S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ
        = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_tᵀ,
    o_t = scale S_t q_t,    S: (B, H, Dv, Dk) float32, beta_t a scalar per (b, t, h).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking

_HIGHEST = jax.lax.Precision.HIGHEST


def gated_delta_reference(q, k, v, beta, log_alpha, S0, reset, *, scale: float):
    """q, k: (B, T, H, Dk); v: (B, T, H, Dv); beta, log_alpha: (B, T, H) float32;
    S0: (B, H, Dv, Dk); reset: (B, T, H) bool. Returns o (B, T, H, Dv) float32 and S_T."""
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

    def step(S, token):
        q_t, k_t, v_t, beta_t, alpha_t = token
        S = alpha_t[..., None, None] * S
        error = v_t - jnp.einsum("bhvk,bhk->bhv", S, k_t, precision=_HIGHEST)
        S = S + (beta_t[..., None] * error)[..., :, None] * k_t[..., None, :]
        return S, scale * jnp.einsum("bhvk,bhk->bhv", S, q_t, precision=_HIGHEST)

    alpha = jnp.moveaxis(chunking.gates(log_alpha, reset), 1, 0)
    S, o = jax.lax.scan(step, S0, (f32(q), f32(k), f32(v), f32(beta), alpha))
    return jnp.moveaxis(o, 0, 1), S
