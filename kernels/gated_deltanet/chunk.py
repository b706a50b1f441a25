"""Chunked gated delta rule (WY / UT-transform form) with matrix multiplies only.

Within a chunk, with decay[t, s] = exp(g_t - g_s) (s <= t, same segment) and from_start_t =
exp(g_t) (no reset in 0..t) from `chunking.chunk_decays`, the state after token t is

    S_t = from_start_t S_in + sum_{s<=t} decay[t, s] u_s k_sᵀ,
    u_s = beta_s (v_s - alpha_s S_{s-1} k_s)                 (the delta-rule correction),

and substituting S_{s-1} gives a unit lower-triangular system for the u's (the UT transform):

    (Id + A) U = beta ⊙ V - (beta ⊙ from_start ⊙ K) S_inᵀ,   A[s, r] = beta_s decay[s, r] (k_s · k_r), r < s.

The inverse T = (Id + A)⁻¹ is formed with matrix multiplies only (`_unit_lower_inverse`: block
inversion, doubling the block size log2(C) times); T [beta ⊙ V | beta ⊙ from_start ⊙ K] gives U~
and W, so U = U~ - W S_inᵀ. Then

    o_t   = scale [ from_start_t S_in q_t + sum_{s<=t} decay[t, s] (q_t · k_s) u_s ]
    S_out = from_start_C S_in + sum_s decay[C, s] u_s ⊗ k_s.

Every exponent is g_t - g_s with s <= t or g_t itself (<= 0): no exp of a positive number.
T, U~, W and the products with q are batched matrix multiplies over all chunks at once; only
U = U~ - W S_inᵀ and S_out need the entering state, a scan over chunks of two matrix multiplies.
Matrix multiplies run in the inputs' dtype when it is 16-bit (float32 accumulation), else
float32; T is formed in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking

DEFAULT_CHUNK_SIZE = 64
_HIGHEST = jax.lax.Precision.HIGHEST


def _unit_lower_inverse(A):
    """(Id + A)⁻¹ for strictly lower-triangular A (..., C, C), by matrix multiplies only.

    Bottom-up block inversion: with the inverses X11, X22 of two adjacent diagonal blocks of size
    b, the inverse of the 2b block they form is [[X11, 0], [-X22 L21 X11, X22]], L21 being the
    block of Id + A below X11. Starting from b = 1 (unit diagonal), log2(C) doublings. C is padded
    to a power of two with an identity block. (No LAPACK triangular solve: on CPU its threaded
    OpenBLAS can stall when several executions run at once.)
    """
    size = A.shape[-1]
    padded = 1 << (size - 1).bit_length()
    A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, padded - size)] * 2)
    batch = A.shape[:-2]
    inverse = jnp.ones((*batch, padded, 1, 1), A.dtype)  # the diagonal blocks' inverses, size b
    block = 1
    while block < padded:
        pairs = padded // (2 * block)
        tiles = A.reshape(*batch, pairs, 2 * block, pairs, 2 * block)
        diagonal = jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)
        lower_left = diagonal[..., block:, :block]
        X11, X22 = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        X21 = -jnp.matmul(X22, jnp.matmul(lower_left, X11, precision=_HIGHEST), precision=_HIGHEST)
        inverse = jnp.concatenate([
            jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1),
            jnp.concatenate([X21, X22], axis=-1)], axis=-2)
        block *= 2
    return inverse[..., 0, :size, :size]


def gated_delta_chunked(q, k, v, beta, log_alpha, S0, reset, *, scale: float,
                        chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Chunked backend; same arguments and returns as `gated_delta_reference`
    (`kernels.gated_deltanet.naive`)."""
    length, dtype = q.shape[1], chunking.compute_dtype(q)
    (q, k, v, beta, log_alpha), reset = chunking.split_chunks((q, k, v, beta, log_alpha), reset,
                                                              chunk_size)
    beta, log_alpha = beta.astype(jnp.float32), log_alpha.astype(jnp.float32)
    (v,), (k, beta, log_alpha), poisoned = chunking.finite_inputs((v,), (k, beta, log_alpha))
    decay, from_start = chunking.chunk_decays(log_alpha, reset)   # (N, B, H, C, C), (N, B, H, C)
    size = v.shape[-2]
    strictly_lower = jnp.arange(size)[:, None] > jnp.arange(size)[None, :]
    gram = chunking.dot("...tk,...sk->...ts", k, k, dtype)
    T = _unit_lower_inverse(jnp.where(strictly_lower, beta[..., :, None] * decay * gram, 0.0))
    U_tilde = chunking.dot("...ts,...sv->...tv", T, beta[..., None] * v, dtype)
    W = chunking.dot("...ts,...sk->...tk", T, (beta * from_start)[..., None] * k, dtype)
    k_to_end = (decay[..., -1, :, None] * k).astype(dtype)
    carry = from_start[..., -1, None, None]

    def chunk(S_in, xs):      # the only sequential part: U = U~ - W S_inᵀ needs S_in
        U_tilde, W, k_to_end, carry, poisoned_rows = xs
        U = U_tilde - chunking.dot("...tk,...vk->...tv", W, S_in, dtype)
        S_out = carry * S_in + chunking.dot("...sv,...sk->...vk", U, k_to_end, dtype)
        return chunking.poison(S_out, poisoned_rows), (S_in, U)

    S, (S_in, U) = jax.lax.scan(chunk, S0, (U_tilde, W, k_to_end, carry, poisoned[..., -1, :]))
    scores = chunking.dot("...tk,...sk->...ts", q, k, dtype) * decay
    o = (chunking.dot("...ts,...sv->...tv", scores, U, dtype)
         + from_start[..., None] * chunking.dot("...vk,...tk->...tv", S_in, q, dtype))
    return chunking.from_chunks(chunking.poison(scale * o, poisoned), length), S
