"""Chunked GLA with matrix multiplies only (the fast non-metaplastic path).

Within a chunk with decay[t, s] = exp(g_t - g_s) (same segment, s <= t):

    o_t   = scale [ from_start_t S_in q_t + sum_s decay[t, s] (q_t · k_s) v_s ]
    S_out = from_start_C S_in + sum_s decay[C, s] v_s ⊗ k_s

The chunk body is rematerialised in the backward pass (`jax.checkpoint`), so only the chunk
inputs and the (B, H, Dv, Dk) state entering each chunk are saved.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking

DEFAULT_CHUNK_SIZE = 64
_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _chunk_step(S_in, xs, scale: float):
    (q, k, v, log_alpha), reset = xs
    q, k, v, log_alpha = (x.astype(jnp.float32) for x in (q, k, v, log_alpha))
    (v,), (k, log_alpha), poisoned = chunking.finite_inputs((v,), (k, log_alpha))
    decay, from_start = chunking.chunk_decays(log_alpha, reset)
    scores = jnp.einsum("bhtk,bhsk->bhts", q, k, precision=_HIGHEST) * decay
    o = (jnp.einsum("bhts,bhsv->bhtv", scores, v, precision=_HIGHEST)
         + from_start[..., None] * jnp.einsum("bhvk,bhtk->bhtv", S_in, q, precision=_HIGHEST))
    S_out = (from_start[..., -1, None, None] * S_in
             + jnp.einsum("bhs,bhsv,bhsk->bhvk", decay[..., -1, :], v, k, precision=_HIGHEST))
    return chunking.poison(S_out, poisoned[..., -1, :]), chunking.poison(scale * o, poisoned)


def gla_chunked(q, k, v, log_alpha, S0, reset, *, scale: float,
                chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Chunked backend; same arguments and returns as `gla_reference` (`kernels.gla.naive`)."""
    chunks, reset = chunking.split_chunks((q, k, v, log_alpha), reset, chunk_size)
    S, o = jax.lax.scan(lambda S_in, xs: _chunk_step(S_in, xs, scale), S0, (chunks, reset))
    return chunking.from_chunks(o, q.shape[1]), S
