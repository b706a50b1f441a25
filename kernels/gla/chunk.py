"""Chunked GLA with matrix multiplies only (the fast non-metaplastic path), parallel over chunks.

Within chunk c with decay[t, s] = exp(g_t - g_s) (same segment, s <= t) and from_start_t:

    local_c = sum_s decay[C, s] v_s ⊗ k_s                       (every chunk at once)
    S_c     = from_start_C S_{c-1} + local_c                    (`chunking.chunk_states`)
    o_t     = scale [ from_start_t S_{c-1} q_t + sum_s decay[t, s] (q_t · k_s) v_s ]

Only the (N, B, H, Dv, Dk) chunk-boundary states come from a scan (a parallel prefix scan of
element-wise products); everything else is batched matrix multiplies over all chunks, in the
inputs' dtype when it is 16-bit (float32 accumulation), else float32.
"""
from __future__ import annotations

from palimpsa_jax.kernels import chunking

DEFAULT_CHUNK_SIZE = 64


def gla_chunked(q, k, v, log_alpha, S0, reset, *, scale: float,
                chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Chunked backend; same arguments and returns as `gla_reference` (`kernels.gla.naive`)."""
    length, dtype = q.shape[1], chunking.compute_dtype(q)
    (q, k, v, log_alpha), reset = chunking.split_chunks((q, k, v, log_alpha), reset, chunk_size)
    (v,), (k, log_alpha), poisoned = chunking.finite_inputs((v,), (k, log_alpha))
    decay, from_start = chunking.chunk_decays(log_alpha, reset)   # (N, B, H, C, C), (N, B, H, C)
    to_end = decay[..., -1, :, None]                                # (N, B, H, C, 1)
    local = chunking.dot("...sv,...sk->...vk", v, to_end * k, dtype)
    local = chunking.poison(local, poisoned[..., -1, :])
    S_in, S = chunking.chunk_states(from_start[..., -1], local, S0)
    scores = chunking.dot("...tk,...sk->...ts", q, k, dtype) * decay
    o = (chunking.dot("...ts,...sv->...tv", scores, v, dtype)
         + from_start[..., None] * chunking.dot("...vk,...tk->...tv", S_in, q, dtype))
    return chunking.from_chunks(chunking.poison(scale * o, poisoned), length), S
