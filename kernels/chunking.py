"""Chunk layout and decay masks shared by the chunked backends.

Time is split into N chunks of C tokens. Chunked tensors have layout (N, B, H, C, ...), so a
`lax.scan` over the leading axis walks the chunks in order. Within a chunk, with chunk-local
cumulative log-decay g_t = sum_{r<=t} log_alpha_r, the state after token t is

    S_t = [no reset in 0..t] exp(g_t) S_in + sum_{s<=t, same segment} exp(g_t - g_s) x_s,

where x_s is the token's rank-one contribution and a reset at token s (a new segment id, or
alpha_s = 0) discards everything before s.

Causality whatever the values: inside a chunk the weights of later tokens are exact zeros, but a
zero weight times a NaN or inf is NaN, so `finite_inputs` replaces non-finite inputs by 0 before
the matrix multiplies and returns where they would have entered the state; the backends then
set those outputs (and the outgoing state) to NaN, from the bad token on. An output at token t
is bit-identical whatever the inputs after t.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


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
    """Pads (B, T, H, ...) arrays and the (B, T, H) reset mask to whole chunks and splits them.

    Returns the arrays as (N, B, H, C, ...) and the reset mask as (N, B, H, C).
    """
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    padded = round_up(reset.shape[1], chunk_size)  # zero tokens leave a linear state unchanged
    split = lambda x: to_chunks(pad_axis(x, 1, padded), chunk_size)
    return tuple(split(x) for x in arrays), split(reset)


def resets(segment_ids, log_alpha):
    """The reset mask and the gates the backends see.

    Args:
      segment_ids: (B, T) integers or None; log_alpha: (B, T, H) floating.
    Returns:
      reset (B, T, H) bool, True where the state is discarded before the token: a change of
      segment id, or alpha = exp(log_alpha) = 0 in float32 (log_alpha = -inf, say);
      log_alpha (B, T, H) float32 with 0 at the resets (so it is finite, and cumulative sums
      stay finite, unless the input holds NaN).
    """
    log_alpha = jnp.asarray(log_alpha, jnp.float32)
    batch, length = log_alpha.shape[:2]
    reset = segment_resets(segment_ids, batch, length)[..., None] | (jnp.exp(log_alpha) == 0)
    return reset, jnp.where(reset, 0.0, log_alpha)


def finite_inputs(row_inputs, token_inputs):
    """Non-finite inputs of a chunk replaced by 0, and where they would have entered the state.

    Args:
      row_inputs: arrays (..., C, Dv) whose element v at token s enters row v of the state (v,
        beta of Palimpsa); token_inputs: arrays (..., C, D) or (..., C) whose token s enters
        every row (k, log_alpha, a scalar beta).
    Returns:
      the row inputs and the token inputs with NaN and inf replaced by 0, and poisoned
      (..., C, Dv) bool: True at (t, v) if a non-finite value entered row v at a token s <= t.
    """
    def clean(x):
        finite = jnp.isfinite(x)
        return jnp.where(finite, x, jnp.zeros((), x.dtype)), ~finite

    rows = [clean(x) for x in row_inputs]
    tokens = [clean(x) for x in token_inputs]
    bad = functools.reduce(jnp.logical_or, [b for _, b in rows])
    for _, b in tokens:
        bad = bad | (jnp.any(b, axis=-1, keepdims=True) if b.ndim == bad.ndim else b[..., None])
    poisoned = jnp.cumsum(bad.astype(jnp.int32), axis=-2) > 0
    return [x for x, _ in rows], [x for x, _ in tokens], poisoned


def poison(x, poisoned):
    """x (..., Dv) or (..., Dv, Dk) with NaN where poisoned (..., Dv) (a select, not a product)."""
    if x.ndim == poisoned.ndim + 1:
        poisoned = poisoned[..., None]
    return jnp.where(poisoned, jnp.nan, x)


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


def compute_dtype(x):
    """The dtype of a backend's matrix multiplies for inputs like x: x's own if it is 16-bit
    (bfloat16, float16; accumulated in float32), else float32."""
    return x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.dtype(jnp.float32)


def dot(spec: str, a, b, dtype):
    """einsum(spec, a, b) -> float32: operands cast to `dtype` (from `compute_dtype`), float32 at
    HIGHEST precision or 16-bit with float32 accumulation."""
    precision = _HIGHEST if dtype == jnp.float32 else None
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=jnp.float32)


def chunk_states(carry, local, S0):
    """The state entering each chunk of the linear recurrence S_c = carry_c S_{c-1} + local_c.

    Args:
      carry: (N, B, H) float32, what of the entering state survives chunk c (from_start at its
        last token); local: (N, B, H, Dv, Dk) float32, chunk c's own contribution; S0: (B, H, Dv, Dk).
    Returns:
      S_in (N, B, H, Dv, Dk), the state entering each chunk, and S_N, the state after the last.
    A parallel prefix scan (`lax.associative_scan`): state c depends on chunks <= c only.
    """
    def combine(earlier, later):
        (f1, s1), (f2, s2) = earlier, later
        return f1 * f2, f2[..., None, None] * s1 + s2

    through, summed = jax.lax.associative_scan(combine, (carry, local))
    S_out = through[..., None, None] * S0 + summed
    return jnp.concatenate([S0[None], S_out[:-1]]), S_out[-1]
