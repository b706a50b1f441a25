"""Causal softmax attention with rotary positions (the Transformer++ mixer)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers.common import Array, rope, segments
from palimpsa_jax.layers.init import DEFAULT_INIT, Init, linear


class KVCache(NamedTuple):
    """Keys and values of up to max_length tokens, (B, L, H, D) each.

    visible (B, L): slots the continuing segment attends to (written and of its segment);
    length (): slots written so far; position (B,): RoPE position of the next token.
    """
    k: Array
    v: Array
    visible: Array
    length: Array
    position: Array


def _check_room(cache: KVCache, length: int) -> None:
    """ValueError if the cache cannot take `length` more tokens (when its fill is concrete)."""
    max_length = cache.k.shape[1]
    filled = None if isinstance(cache.length, jax.core.Tracer) else int(cache.length)
    if length > max_length or (filled is not None and filled + length > max_length):
        raise ValueError(f"cache has room for {max_length - (filled or 0)} more tokens of its "
                         f"max_length {max_length}, got {length}: use a larger max_length")


def implementation(backend: str, dtype, head_dim: int) -> str:
    """`jax.nn.dot_product_attention`'s implementation for a training forward: "cudnn" (flash
    attention, no (T, T) scores in memory) when backend is "auto" on a GPU with 16-bit inputs and
    head_dim <= 128 (what cuDNN supports), else "xla"."""
    fits = jnp.dtype(dtype).itemsize == 2 and head_dim <= 128
    return "cudnn" if backend == "auto" and fits and jax.default_backend() == "gpu" else "xla"


class Attention(nnx.Module):
    """o_t = W_o softmax(q_t Kᵀ / sqrt(D)) V over earlier tokens of the same segment, with RoPE on
    q and k at in-segment positions. H heads of head_dim D; no biases.

    backend: "auto" runs the cache-free forward through cuDNN's flash attention on GPUs
    (`implementation`); any other value of the model's kernel backend runs XLA's softmax.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, rope_theta: float = 10000.0,
                 backend: str = "auto", init: Init = DEFAULT_INIT, dtype=None, rngs: nnx.Rngs):
        self.num_heads, self.head_dim, self.rope_theta = num_heads, head_dim, rope_theta
        self.backend = backend
        inner = num_heads * head_dim
        to_heads = functools.partial(linear, d_model, inner, ("embed", "heads"), rngs,
                                     std=init.std, dtype=dtype)
        self.W_q, self.W_k, self.W_v = to_heads(), to_heads(), to_heads()
        self.W_o = linear(inner, d_model, ("heads", "embed"), rngs, std=init.std, dtype=dtype)

    def init_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_length, self.num_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                       jnp.zeros((batch, max_length), bool), jnp.zeros((), jnp.int32),
                       jnp.zeros((batch,), jnp.int32))

    def __call__(self, x: Array, *, segment_ids: Array | None = None,
                 cache: KVCache | None = None) -> tuple[Array, KVCache | None]:
        """x: (B, T, d_model) -> y (B, T, d_model), cache. With a cache the first segment of x
        continues the cached one; the cache must have room for T more tokens."""
        batch, length, _ = x.shape
        seg = segments(segment_ids, batch, length)
        t = jnp.arange(length, dtype=jnp.int32)
        positions = seg.position if cache is None else jnp.where(
            seg.index == 0, cache.position[:, None] + t, seg.position)
        split = lambda z: z.reshape(batch, length, self.num_heads, self.head_dim)
        q = rope(split(self.W_q(x)), positions, self.rope_theta)
        k = rope(split(self.W_k(x)), positions, self.rope_theta)
        v = split(self.W_v(x))
        if cache is None:
            return self.W_o(self._attend(q, k, v, segment_ids, seg.index)), None
        # cached slots are segment 0 if visible, -1 (never matched) otherwise
        _check_room(cache, length)
        write = lambda buffer, new: jax.lax.dynamic_update_slice_in_dim(
            buffer, new.astype(buffer.dtype), cache.length, axis=1)
        keys, values = write(cache.k, k), write(cache.v, v)
        key_index = write(jnp.where(cache.visible, 0, -1), seg.index)
        query_slot = cache.length + t
        key_slot = jnp.arange(keys.shape[1], dtype=jnp.int32)
        mask = ((key_index[:, None, :] == seg.index[:, :, None])
                & (key_slot[None, None, :] <= query_slot[None, :, None]))       # (B, T, S)
        scores = jnp.einsum("bthd,bshd->bhts", q, keys.astype(q.dtype),
                            preferred_element_type=jnp.float32) * self.head_dim**-0.5
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhts,bshd->bthd", weights, values.astype(v.dtype))
        y = self.W_o(o.reshape(batch, length, -1))
        # An overflow that could not be checked eagerly (under jit) poisons y instead of
        # silently overwriting the last slots.
        y = jnp.where(cache.length + length <= keys.shape[1], y, jnp.nan)
        written = key_slot < cache.length + length
        new_cache = KVCache(keys, values, written & (key_index == seg.index[:, -1:]),
                            cache.length + length, positions[:, -1] + 1)
        return y, new_cache

    def _attend(self, q: Array, k: Array, v: Array, segment_ids, index: Array) -> Array:
        """Causal attention within segments without a cache: (B, T, H, D) each -> (B, T, H * D)."""
        mask = None if segment_ids is None else (index[:, None, :, None] == index[:, None, None, :])
        o = jax.nn.dot_product_attention(
            q, k, v.astype(q.dtype), mask=mask, is_causal=True,
            implementation=implementation(self.backend, q.dtype, self.head_dim))
        return o.reshape(*o.shape[:2], -1)
