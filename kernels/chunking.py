"""Chunk layout and decay masks shared by the chunked backends.

Time is split into N chunks of C tokens. Chunked tensors have layout (N, B, H, C, ...), so a
`lax.scan` over the leading axis walks the chunks in order. Within a chunk, with chunk-local
cumulative log-decay g_t = sum_{r<=t} log_alpha_r, the state after token t is

    S_t = [no reset in 0..t] exp(g_t) S_in + sum_{s<=t, same segment} exp(g_t - g_s) x_s,

where x_s is the token's rank-one contribution and a reset at token s (a new segment id) discards
everything before s.
"""
from __future__ import annotations

import jax.numpy as jnp


def to_chunks(x, chunk_size: int):
    """(B, T, H, ...) with T a multiple of C -> (N, B, H, C, ...)."""
    batch, length = x.shape[:2]
    x = x.reshape(batch, length // chunk_size, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2))


def from_chunks(x, length: int):
    """(N, B, H, C, ...) -> (B, length, H, ...), dropping the padding."""
    x = jnp.moveaxis(x, (1, 0, 3, 2), (0, 1, 2, 3))
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :length]


def split_chunks(arrays, reset, chunk_size: int):
    """Pads (B, T, H, ...) arrays and the (B, T) reset mask to whole chunks and splits them.

    Returns the arrays as (N, B, H, C, ...) and the reset mask as (N, B, 1, C).
    """
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    padded = round_up(reset.shape[1], chunk_size)  # zero tokens leave a linear state unchanged
    split = lambda x: to_chunks(pad_axis(x, 1, padded), chunk_size)
    return tuple(split(x) for x in arrays), split(reset[:, :, None])


def segment_resets(segment_ids, batch: int, length: int):
    """(B, T) bool, True where the state resets before the token (the id changes). None -> all False."""
    if segment_ids is None:
        return jnp.zeros((batch, length), bool)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((batch, 1), bool), change], axis=1)


def chunk_decays(log_alpha, reset):
    """Decay weights of one chunk.

    Args:
      log_alpha: (..., C) float32 log forget gates.
      reset: (..., C) bool, broadcastable to log_alpha.
    Returns:
      decay: (..., C, C), decay[t, s] = exp(g_t - g_s) if s <= t in the same segment, else 0.
      from_start: (..., C), exp(g_t) if no reset in 0..t (the incoming state is still alive), else 0.
    """
    g = jnp.cumsum(log_alpha, axis=-1)
    segment = jnp.cumsum(reset.astype(jnp.int32), axis=-1)
    size = log_alpha.shape[-1]
    causal = jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]
    same = (segment[..., :, None] == segment[..., None, :]) & causal
    decay = jnp.exp(jnp.where(same, g[..., :, None] - g[..., None, :], -jnp.inf))
    from_start = jnp.exp(jnp.where(segment == 0, g, -jnp.inf))
    return decay, from_start


def round_up(size: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= size."""
    return -(-size // multiple) * multiple


def pad_axis(x, axis: int, size: int, value=0.0):
    """Pads `axis` of x at the end to `size` with `value` (no-op when already that size)."""
    axis = axis % x.ndim
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def gates(log_alpha, reset):
    """Per-token decay alpha_t = exp(log_alpha_t), zeroed where the state resets (float32).

    A kernel that consumes these gates returns dL/dalpha_t; dL/dlog_alpha_t = dL/dalpha_t · alpha_t.
    """
    return jnp.where(reset, 0.0, jnp.exp(log_alpha.astype(jnp.float32)))
