"""Pieces shared by every mixer: parameters with logical axis names, norms, the causal short
convolution, SwiGLU, RoPE and packed-sequence bookkeeping.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, `vocab`, `conv`, `rank`) as
sharding metadata and are created without eager sharding, so no layer needs a mesh: a trainer
reads `nnx.get_partition_spec(nnx.state(model))` and maps the names to mesh axes with its rules.
Parameters that must not be weight-decayed carry `weight_decay=False` (see
`palimpsa_jax.models.weight_decay_mask`).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
init = nnx.initializers


class Constant(nnx.Variable):
    """A non-trainable variable (e.g. a fixed prior): not an `nnx.Param`, so optimisers skip it."""


def param(initializer, shape, names, rngs: nnx.Rngs, *, weight_decay=True, variable=nnx.Param):
    """A float32 variable of `shape` with logical axis `names`, drawn from `initializer`."""
    metadata = {} if weight_decay else {"weight_decay": False}
    partitioned = nnx.with_partitioning(initializer, tuple(names), eager_sharding=False, **metadata)
    return variable(partitioned(rngs.params(), shape, jnp.float32))


def linear(d_in: int, d_out: int, names, rngs: nnx.Rngs, *, bias=False, stddev=0.02,
           dtype=None) -> nnx.Linear:
    """Dense layer (d_in -> d_out), kernel N(0, stddev²) named `names`, optional zero bias;
    float32 parameters, computation in `dtype` (None: promote input and parameters)."""
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
        kernel_init=nnx.with_partitioning(init.normal(stddev), tuple(names), eager_sharding=False),
        bias_init=nnx.with_partitioning(init.zeros_init(), (names[1],), eager_sharding=False,
                                        weight_decay=False))


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
        self.scale = param(init.ones_init(), (d,), ("embed",), rngs, weight_decay=False)

    def __call__(self, x: Array) -> Array:
        return (rms_normalize(x, self.eps) * self.scale[...]).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm over groups of `group_size` channels, gated by SiLU(gate); x, gate: (..., d).

    norm_before_gate=True: norm(x) * scale * SiLU(gate) (Gated DeltaNet / Palimpsa-D, one group
    per head); False: norm(x * SiLU(gate)) * scale (Mamba2's RMSNormGated, d / n_groups channels
    per group).
    """

    def __init__(self, d: int, group_size: int, *, norm_before_gate: bool, eps: float = 1e-5,
                 rngs: nnx.Rngs):
        self.group_size, self.norm_before_gate, self.eps = group_size, norm_before_gate, eps
        self.scale = param(init.ones_init(), (d,), ("heads",), rngs, weight_decay=False)

    def __call__(self, x: Array, gate: Array) -> Array:
        gate = jax.nn.silu(gate.astype(jnp.float32))
        y = x.astype(jnp.float32) if self.norm_before_gate else x.astype(jnp.float32) * gate
        y = rms_normalize(y.reshape(*y.shape[:-1], -1, self.group_size), self.eps).reshape(x.shape)
        y = y * self.scale[...]
        return (y * gate if self.norm_before_gate else y).astype(x.dtype)


class SwiGLU(nnx.Module):
    """MLP W_down(SiLU(W_gate x) * W_up x): (..., d_model) -> (..., d_model)."""

    def __init__(self, d_model: int, hidden: int, *, dtype=None, rngs: nnx.Rngs):
        self.W_gate = linear(d_model, hidden, ("embed", "mlp"), rngs, dtype=dtype)
        self.W_up = linear(d_model, hidden, ("embed", "mlp"), rngs, dtype=dtype)
        self.W_down = linear(hidden, d_model, ("mlp", "embed"), rngs, dtype=dtype)

    def __call__(self, x: Array) -> Array:
        return self.W_down(jax.nn.silu(self.W_gate(x)) * self.W_up(x))


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
    PyTorch's depthwise Conv1d weight (C, 1, W) transposed.
    """

    def __init__(self, channels: int, width: int = 4, *, bias: bool = False, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(width)  # PyTorch Conv1d default (fan_in = width)
        self.width = width
        self.weight = param(lambda k, s, d: jax.random.uniform(k, s, d, -bound, bound),
                            (width, channels), ("conv", "heads"), rngs)
        self.bias = (param(init.zeros_init(), (channels,), ("heads",), rngs, weight_decay=False)
                     if bias else None)

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


# --- time steps and forgetting (Mamba2 parametrisation) ------------------------------------

def inverse_softplus(x: Array) -> Array:
    return x + jnp.log(-jnp.expm1(-x))


def time_step_bias(num_heads: int, rngs: nnx.Rngs, *, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4):
    """dt_bias (H,) such that softplus(dt_bias) is log-uniform in [dt_min, dt_max], >= dt_floor."""
    def initializer(key, shape, dtype):
        log_dt = jax.random.uniform(key, shape, dtype, math.log(dt_min), math.log(dt_max))
        return inverse_softplus(jnp.maximum(jnp.exp(log_dt), dt_floor))

    return param(initializer, (num_heads,), ("heads",), rngs, weight_decay=False)


def decay_rate_log(num_heads: int, rngs: nnx.Rngs, *, a_min=1.0, a_max=16.0):
    """A_log (H,) with A = exp(A_log) uniform in [a_min, a_max]."""
    return param(lambda k, s, d: jnp.log(jax.random.uniform(k, s, d, a_min, a_max)),
                 (num_heads,), ("heads",), rngs, weight_decay=False)
