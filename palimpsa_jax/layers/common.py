"""Pieces shared by every mixer: norms, the causal short convolution, SwiGLU, RoPE and
packed-sequence bookkeeping. Parameters are created by `palimpsa_jax.layers.init`."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers.init import initializers, linear, normal, param, uniform

Array = jax.Array


def rms_normalize(x: Array, eps: float) -> Array:
    """x / rms(x) over the last axis, computed in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """x / ||x|| over the last axis (per head), in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale over the last axis (d,); output in x's dtype."""

    def __init__(self, d: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(initializers.ones_init(), (d,), ("embed",), rngs, weight_decay=False)

    def __call__(self, x: Array) -> Array:
        return (rms_normalize(x, self.eps) * self.scale[...]).astype(x.dtype)


class LayerNorm(nnx.Module):
    """y = (x - mean(x)) / std(x) * scale + bias over the last axis (d,), computed in float32;
    output in x's dtype."""

    def __init__(self, d: int, *, eps: float = 1e-5, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(initializers.ones_init(), (d,), ("embed",), rngs, weight_decay=False)
        self.bias = param(initializers.zeros_init(), (d,), ("embed",), rngs, weight_decay=False)

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm over groups of `group_size` channels, gated by SiLU(gate); x, gate: (..., d).

    norm_before_gate=True: norm(x) * scale * SiLU(gate) (Gated DeltaNet / Palimpsa-D, one group
    per head); False: norm(x * SiLU(gate)) * scale (Mamba2's RMSNormGated, d / n_groups channels
    per group).
    """

    def __init__(self, d: int, group_size: int, *, norm_before_gate: bool, eps: float = 1e-5,
                 rngs: nnx.Rngs):
        self.group_size, self.norm_before_gate, self.eps = group_size, norm_before_gate, eps
        self.scale = param(initializers.ones_init(), (d,), ("heads",), rngs, weight_decay=False)

    def __call__(self, x: Array, gate: Array) -> Array:
        gate = jax.nn.silu(gate.astype(jnp.float32))
        y = x.astype(jnp.float32) if self.norm_before_gate else x.astype(jnp.float32) * gate
        y = rms_normalize(y.reshape(*y.shape[:-1], -1, self.group_size), self.eps).reshape(x.shape)
        y = y * self.scale[...]
        return (y * gate if self.norm_before_gate else y).astype(x.dtype)


class SwiGLU(nnx.Module):
    """MLP W_down(SiLU(W_gate x) * W_up x): (..., d_model) -> (..., d_model); kernels N(0, std²)."""

    def __init__(self, d_model: int, hidden: int, *, std: float = 0.02, dtype=None,
                 rngs: nnx.Rngs):
        self.W_gate = linear(d_model, hidden, ("embed", "mlp"), rngs, std=std, dtype=dtype)
        self.W_up = linear(d_model, hidden, ("embed", "mlp"), rngs, std=std, dtype=dtype)
        self.W_down = linear(hidden, d_model, ("mlp", "embed"), rngs, std=std, dtype=dtype)

    def __call__(self, x: Array) -> Array:
        return self.W_down(jax.nn.silu(self.W_gate(x)) * self.W_up(x))


# --- embedding lookup ----------------------------------------------------------------------

@jax.custom_vjp
def embedding_lookup(table: Array, tokens: Array) -> Array:
    """table[tokens]: (V, D), (...) int -> (..., D), with a gradient that needs no atomics.

    The gradient of a gather is a scatter-add of one row per token; on GPUs its atomic adds
    serialise on repeated ids (an MQAR batch is mostly token 0: 0.55 s of a 0.6 s H200 step).
    Here the backward sorts the tokens, sums each run of equal ids with a segmented scan
    (in float32, or the table's dtype if wider; deterministic) and writes each distinct id's row
    once.
    """
    return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens):
    return jnp.take(table, tokens, axis=0), (tokens, table)   # the table: a live parameter


def _lookup_bwd(residuals, d_rows):
    tokens, table = residuals
    vocab, dtype = table.shape[0], table.dtype
    accumulate = jnp.promote_types(dtype, jnp.float32)
    ids = tokens.reshape(-1)
    order = jnp.argsort(ids)
    ids = ids[order]
    rows = d_rows.reshape(-1, d_rows.shape[-1])[order].astype(accumulate)
    starts = jnp.concatenate([jnp.ones(1, bool), ids[1:] != ids[:-1]])

    def combine(a, b):   # segmented sum: b's running total restarts where b starts a run
        (a_sum, a_start), (b_sum, b_start) = a, b
        return jnp.where(b_start[..., None], b_sum, a_sum + b_sum), a_start | b_start

    sums, _ = jax.lax.associative_scan(combine, (rows, starts))
    ends = jnp.concatenate([starts[1:], jnp.ones(1, bool)])   # the last row of each run
    target = jnp.where(ends, ids, vocab)                        # other rows: out of range
    d_table = jnp.zeros((vocab, rows.shape[-1]), accumulate).at[target].add(
        sums, mode="drop", unique_indices=True)
    return d_table.astype(dtype), None


embedding_lookup.defvjp(_lookup_fwd, _lookup_bwd)


# --- packed sequences ----------------------------------------------------------------------

class Segments(NamedTuple):
    """Per-token segment bookkeeping of one call, (B, T) each.

    index: 0 for the first segment of the call (the one that continues a cache), then 1, 2, ...;
    position: tokens since the start of the token's segment within the call.
    """
    index: Array
    position: Array


def segments(segment_ids: Array | None, batch: int, length: int) -> Segments:
    """Segment index and in-segment position of every token; one segment if ids are None."""
    t = jnp.arange(length, dtype=jnp.int32)
    if segment_ids is None:
        zeros = jnp.zeros((batch, length), jnp.int32)
        return Segments(zeros, zeros + t)
    starts = jnp.concatenate([jnp.zeros((batch, 1), bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    index = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    start_position = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return Segments(index, t - start_position)


# --- short convolution -------------------------------------------------------------------

class ShortConv(nnx.Module):
    """Causal depthwise convolution of width W over time: (B, T, C) -> (B, T, C).

    y_t = sum_i weight[i] x_{t-W+1+i} (+ bias), where inputs from another segment count as 0.
    The cache holds the last W-1 inputs (B, W-1, C) of the current segment. Weight (W, C) is
    PyTorch's depthwise Conv1d weight (C, 1, W) transposed: N(0, std²), or with std None
    PyTorch's default U(±1/sqrt(W)); bias 0.
    """

    def __init__(self, channels: int, width: int = 4, *, bias: bool = False,
                 std: float | None = None, rngs: nnx.Rngs):
        self.width = width
        weight_init = uniform(1.0 / math.sqrt(width)) if std is None else normal(std)
        self.weight = param(weight_init, (width, channels), ("conv", "heads"), rngs)
        self.bias = (param(initializers.zeros_init(), (channels,), ("heads",), rngs,
                           weight_decay=False) if bias else None)

    def init_cache(self, batch: int, dtype=jnp.float32) -> Array:
        return jnp.zeros((batch, self.width - 1, self.weight.shape[1]), dtype)

    def __call__(self, x: Array, segment_index: Array, cache: Array | None = None
                 ) -> tuple[Array, Array]:
        """x: (B, T, C); segment_index: (B, T) from `segments`; cache: (B, W-1, C) or None.
        Returns y (B, T, C) in x's dtype and the new cache (in the given cache's dtype)."""
        batch, length, _ = x.shape
        past = self.init_cache(batch, x.dtype) if cache is None else cache.astype(x.dtype)
        padded = jnp.concatenate([past, x], axis=1)                         # (B, W-1+T, C)
        padded_index = jnp.pad(segment_index, ((0, 0), (self.width - 1, 0)))  # cache: segment 0
        weight = self.weight[...]
        y = jnp.zeros(x.shape, jnp.float32)
        for i in range(self.width):
            same = padded_index[:, i:i + length] == segment_index
            y = y + jnp.where(same[..., None], padded[:, i:i + length], 0) * weight[i]
        if self.bias is not None:
            y = y + self.bias[...]
        tail, tail_index = padded[:, -(self.width - 1):], padded_index[:, -(self.width - 1):]
        new_cache = jnp.where((tail_index == segment_index[:, -1:])[..., None], tail, 0)
        return y.astype(x.dtype), new_cache.astype(x.dtype if cache is None else cache.dtype)


class RecurrentCache(NamedTuple):
    """Decoding cache of a recurrent mixer: short-conv caches (each (B, W-1, C)) and the
    memory's state."""
    conv: tuple[Array, ...]
    state: Any


# --- rotary position embedding -------------------------------------------------------------

def rope(x: Array, positions: Array, theta: float = 10000.0) -> Array:
    """Rotary embedding (rotate-half convention): x (B, T, H, D), positions (B, T)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq    # (B, T, 1, D/2)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
