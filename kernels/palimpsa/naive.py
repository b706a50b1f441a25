"""Sequential reference of the metaplastic recurrence (natural-parameter form, README
"The kernel API"; arXiv 2602.09075).

One `lax.scan` step per token over the float32 state (M, Ibar), both (B, H, Dv, Dk):

    M_t    = alpha_t M_{t-1}    + v_t ⊗ k_t
    Ibar_t = alpha_t Ibar_{t-1} + beta_t ⊗ k_t²
    o_t    = scale (M_t / (Ibar_t + prior)) q_t
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking


def readout(M, Ibar, prior, q, scale: float, return_variance: bool):
    """Posterior-mean read-out and predictive variance.

    Args:
      M, Ibar: (..., Dv, Dk) natural parameters; prior broadcastable to them.
      q: (..., Dk) query.
    Returns:
      o: (..., Dv) = scale (M / I) q and variance (..., Dv) = scale² (1 / I) q², or None.
    """
    plasticity = 1.0 / (Ibar + prior)
    o = scale * jnp.sum(M * plasticity * q[..., None, :], axis=-1)
    variance = scale**2 * jnp.sum(plasticity * (q * q)[..., None, :], axis=-1) if return_variance else None
    return o, variance


def direct_cotangents(M, Ibar, prior, q, d_o, d_var, scale: float, reciprocal=jnp.reciprocal):
    """What a read-out gives dL/dM and dL/dIbar directly (not through later states), and the
    plasticity 1 / I and posterior mean mu, each of the states' shape (a (block_v, Dk') tile at
    one token, or one row at every token of a chunk); prior, q (along Dk), d_o and d_var (along
    Dv, or None) broadcast against it. reciprocal: how 1 / I is computed (a kernel's own)."""
    plasticity = reciprocal(Ibar + prior)
    mu = M * plasticity
    d_M = scale * d_o * q * plasticity
    d_precision = scale * d_o * q * mu
    if d_var is not None:
        d_precision += scale * scale * d_var * (q * q) * plasticity
    return d_M, -plasticity * d_precision, plasticity, mu


def palimpsa_reference(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, *, scale: float,
                       return_variance: bool):
    """Sequential scan over tokens; the contract of every Palimpsa backend.

    Args:
      q, k: (B, T, H, Dk); v, beta: (B, T, H, Dv); log_alpha: (B, T, H) float32, finite;
      prior: (H, Dv, Dk) float32; M0, Ibar0: (B, H, Dv, Dk) float32; reset: (B, T, H) bool,
      True where the state is discarded before the token.
    Returns:
      o (B, T, H, Dv) float32, variance (B, T, H, Dv) float32 or None, M_T, Ibar_T.
    """
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

    def step(state, token):
        M, Ibar = state
        q_t, k_t, v_t, beta_t, alpha_t = token
        alpha = alpha_t[..., None, None]
        M = alpha * M + v_t[..., :, None] * k_t[..., None, :]
        Ibar = alpha * Ibar + beta_t[..., :, None] * (k_t * k_t)[..., None, :]
        return (M, Ibar), readout(M, Ibar, prior, q_t, scale, return_variance)

    alpha = chunking.gates(log_alpha, reset)
    tokens = (f32(q), f32(k), f32(v), f32(beta), jnp.moveaxis(alpha, 1, 0))
    (M, Ibar), (o, variance) = jax.lax.scan(step, (M0, Ibar0), tokens)
    variance = None if variance is None else jnp.moveaxis(variance, 0, 1)
    return jnp.moveaxis(o, 0, 1), variance, M, Ibar
