"""Pallas GPU (Triton) chunked GLA, forward and backward, with tensor-core matrix multiplies.

Notation of `kernels.gla.chunk`, per (batch, head) and chunk n of C tokens: g_t the chunk-local
cumulative log decay, seg_t the number of resets in the chunk up to t, decay[t, s] =
exp(g_t - g_s) for s <= t in one segment (else 0), from_start_t = exp(g_t) while seg_t = 0,
to_end_s = exp(g_{C-1} - g_s) for s in the chunk's last segment, carry = from_start_{C-1}.
Four kernel launches, each a `pallas_call`:

  states       `_scan` forward, grid (B, H, Dv tiles, Dk tiles), the chunks walked in order:
               S_in of every chunk and the final state, S_n = carry S_{n-1} + (to_end ⊙ V)ᵀ K.
  output       grid (B, H, N, Dv tiles): o = scale [from_start ⊙ (Q S_inᵀ) + (QKᵀ ⊙ decay) V].
  cotangents   `_scan` in reverse, same grid, the chunks walked backwards: dS_out of every
               chunk and dS_0, dS_in = carry dS_out + scale (from_start ⊙ dO)ᵀ Q.
  gradients    grid (B, H, N):  dA = dO Vᵀ ⊙ decay (scale folded in),
               dq = dA K + scale from_start ⊙ (dO S_in),   dk = dAᵀ Q + to_end ⊙ (V dS_out),
               dv = scale (QKᵀ ⊙ decay)ᵀ dO + to_end ⊙ (K dS_outᵀ),
               dL/dg_t = q_t·dq_t - k_t·dk_t, plus carry <dS_out, S_in> + Σ_s to_end_s v_sᵀ dS_out k_s
               at the chunk's last token (what flows through carry and to_end).

The custom VJP takes g itself (its chunk-local cumulative sum is XLA's, differentiated by
autodiff) and saves only the inputs: the backward recomputes the states. Inputs stay in their
(B, T, H, D) layout; Dk and Dv are padded inside the kernels to powers of two (at least 16), T
to whole chunks. Matrix multiplies take 16-bit inputs in 16 bits with float32 accumulation (as
flash-linear-attention does), float32 inputs in float32 (IEEE); states are carried in float32.
The forward stores the state entering each chunk in the compute dtype, in which the output
kernel multiplies it anyway (the same output, half the traffic for 16-bit inputs); the
backward's recomputed states stay float32.

Causality whatever the values: decay masks are selects, not products, and a non-finite value is
replaced by 0 where it would meet a masked (zero) weight of an earlier output (v in the output
kernel), its outputs from that token on set to NaN; the states take the raw values, so a NaN
reaches every later chunk.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from palimpsa_jax.kernels import chunking, validation

DEFAULT_CHUNK_SIZE = 64
DEFAULT_BLOCK = 64          # rows and columns of a state tile in the sequential kernels
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2      # load pipelining of the scans over chunks (forward and reverse)


def width(size: int) -> int:
    """A feature axis padded inside the kernels: a power of two, at least 16 (Triton's dot)."""
    return max(16, pl.next_power_of_2(size))


def dot(a, b, contract: tuple[int, int], dtype):
    """a · b contracting axis contract[0] of a with axis contract[1] of b (2-D), float32 sums,
    operands cast to `dtype`; float32 operands multiply in IEEE float32 (Triton's default for
    them is TF32)."""
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype),
                               (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def gates(g, seg, g_last, seg_last):
    """decay (C, C) as exp(g_t - g_s) where valid (a select; 0 elsewhere), the validity mask,
    from_start (C,), to_end (C,) and carry (scalar) of one chunk."""
    size = g.shape[0]
    token = jnp.arange(size)
    same = (seg[:, None] == seg[None, :]) & (token[:, None] >= token[None, :])
    decay = jnp.exp(jnp.where(same, g[:, None] - g[None, :], -jnp.inf))
    from_start = jnp.where(seg == 0, jnp.exp(g), 0.0)
    to_end = jnp.where(seg == seg_last, jnp.exp(g_last - g), 0.0)
    carry = jnp.where(seg_last == 0, jnp.exp(g_last), 0.0)
    return decay, same, from_start, to_end, carry


def masks(columns: int, size: int, tile_axis: int | None = None):
    """(columns,) bool, True for the columns < size of this program's tile along `tile_axis`."""
    start = 0 if tile_axis is None else pl.program_id(tile_axis) * columns
    return start + jnp.arange(columns) < size


def load_rows(ref, mask, dtype=None):
    """A (rows, width) block, zero in the masked columns."""
    x = plgpu.load(ref, mask=mask[None, :], other=0.0)
    return x if dtype is None else x.astype(dtype)


def chunk_gates(g_ref, seg_ref, start, chunk_size):
    """g, seg (C,) of the chunk starting at token `start` of a (T,) block, and its last g, seg."""
    rows = pl.ds(start, chunk_size)
    last = start + chunk_size - 1
    return g_ref[rows], seg_ref[rows], g_ref[last], seg_ref[last]


def _scan_kernel(keys_ref, values_ref, g_ref, seg_ref, init_ref, each_ref, last_ref, *,
                 chunk_size, scale, reverse, dk, dv, dtype):
    """One (b, h, v-tile, k-tile) program of a scan over the chunks: stores the carried tile as
    it enters each chunk, then X = carry X + (weight ⊙ values)ᵀ keys.

    Forward (reverse=False, keys k, values v): X is the state S, weight to_end.
    Reverse (reverse=True, keys q, values dO): X is the cotangent of the state leaving a chunk,
    weight scale ⊙ from_start; what it stores per chunk is dS_out, what it ends with dS_0.
    """
    num_chunks, block_v, block_k = each_ref.shape
    k_mask, v_mask = masks(block_k, dk, 3), masks(block_v, dv, 2)

    def chunk(r, X):
        n = num_chunks - 1 - r if reverse else r
        each_ref[n] = X.astype(each_ref.dtype)
        start = n * chunk_size
        rows = pl.ds(start, chunk_size)
        g, seg, g_last, seg_last = chunk_gates(g_ref, seg_ref, start, chunk_size)
        _, _, from_start, to_end, carry = gates(g, seg, g_last, seg_last)
        weight = scale * from_start if reverse else to_end
        keys = load_rows(keys_ref.at[rows], k_mask)
        values = load_rows(values_ref.at[rows], v_mask, jnp.float32)
        return carry * X + dot(weight[:, None] * values, keys, (0, 0), dtype)

    last_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, init_ref[...])


def _output_kernel(q_ref, k_ref, v_ref, g_ref, seg_ref, S_in_ref, o_ref, *, scale, dk, dv, dtype):
    """One (b, h, chunk, v-tile) program: the chunk's outputs from its entering state."""
    k_mask, v_mask = masks(q_ref.shape[-1], dk), masks(v_ref.shape[-1], dv, 3)
    g, seg = g_ref[...], seg_ref[...]
    last = g.shape[0] - 1
    decay, same, from_start, _, _ = gates(g, seg, g_ref[last], seg_ref[last])
    q, k = load_rows(q_ref, k_mask), load_rows(k_ref, k_mask)
    v = load_rows(v_ref, v_mask)
    bad = ~jnp.isfinite(v)
    scores = jnp.where(same, dot(q, k, (1, 1), dtype) * decay, 0.0)
    o = (dot(scores, jnp.where(bad, 0.0, v), (1, 0), dtype)
         + from_start[:, None] * dot(q, S_in_ref[...], (1, 1), dtype))
    poisoned = jnp.cumsum(bad.astype(jnp.int32), axis=0) > 0
    plgpu.store(o_ref, jnp.where(poisoned, jnp.nan, scale * o).astype(o_ref.dtype),
                mask=v_mask[None, :])


def _gradients_kernel(q_ref, k_ref, v_ref, do_ref, g_ref, seg_ref, S_in_ref, dS_out_ref,
                      dq_ref, dk_ref, dv_ref, dg_ref, *, scale, dk, dv, dtype):
    """One (b, h, chunk) program: the gradients of the chunk's inputs."""
    k_mask, v_mask = masks(q_ref.shape[-1], dk), masks(v_ref.shape[-1], dv)
    g, seg = g_ref[...], seg_ref[...]
    last = g.shape[0] - 1
    decay, same, from_start, to_end, carry = gates(g, seg, g_ref[last], seg_ref[last])
    q, k = load_rows(q_ref, k_mask), load_rows(k_ref, k_mask)
    v, do = load_rows(v_ref, v_mask), load_rows(do_ref, v_mask)
    S_in, dS_out = S_in_ref[...], dS_out_ref[...]
    scores = jnp.where(same, dot(q, k, (1, 1), dtype) * decay, 0.0)
    d_scores = jnp.where(same, scale * dot(do, v, (1, 1), dtype) * decay, 0.0)
    dq = dot(d_scores, k, (1, 0), dtype) + (scale * from_start)[:, None] * dot(do, S_in, (1, 0), dtype)
    dk_state = to_end[:, None] * dot(v, dS_out, (1, 0), dtype)
    dk_ = dot(d_scores, q, (0, 0), dtype) + dk_state
    dv_ = (dot(scale * scores, do, (0, 0), dtype)
           + to_end[:, None] * dot(k, dS_out, (1, 1), dtype))
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    dg = jnp.sum(q32 * dq, axis=1) - jnp.sum(k32 * dk_, axis=1)
    through_end = carry * jnp.sum(dS_out * S_in) + jnp.sum(k32 * dk_state)
    dg_ref[...] = jnp.where(jnp.arange(g.shape[0]) == last, dg + through_end, dg)
    plgpu.store(dq_ref, dq.astype(dq_ref.dtype), mask=k_mask[None, :])
    plgpu.store(dk_ref, dk_.astype(dk_ref.dtype), mask=k_mask[None, :])
    plgpu.store(dv_ref, dv_.astype(dv_ref.dtype), mask=v_mask[None, :])


class Config(NamedTuple):
    """The static settings of one call."""
    chunk_size: int
    scale: float
    block: int
    num_warps: int
    num_stages: int
    interpret: bool
    backward_num_warps: int

    def backward(self) -> Config:
        """The settings of the backward pass's kernels (its recomputations included)."""
        return self._replace(num_warps=self.backward_num_warps)


def compiler(config, name: str, sequential: bool = False) -> dict:
    """pallas_call settings; `sequential` kernels loop over chunks and pipeline their loads
    config.num_stages deep."""
    stages = config.num_stages if sequential else 1
    return dict(compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=stages),
                interpret=config.interpret, name=name)


def sizes(q, v, block: int):
    """(B, T, H, Dk, Dv, Dk padded, Dv padded, state tile rows, state tile columns)."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    dk_pad, dv_pad = width(dk), width(dv)
    return batch, length, heads, dk, dv, dk_pad, dv_pad, min(block, dv_pad), min(block, dk_pad)


def _scan(keys, values, g, seg, init, config, *, reverse: bool, states_dtype=jnp.float32):
    """`_scan_kernel` over every (b, h) and state tile: keys (B, T, H, Dk), values (B, T, H, Dv),
    init (B, H, Dv', Dk') float32. Returns the tile entering each chunk (B, H, N, Dv', Dk') in
    `states_dtype` and the last (B, H, Dv', Dk') float32 (padded)."""
    batch, length, heads, dk, dv, dk_pad, dv_pad, block_v, block_k = sizes(keys, values,
                                                                             config.block)
    num_chunks = length // config.chunk_size
    state = pl.BlockSpec((None, None, block_v, block_k), lambda b, h, i, j: (b, h, i, j))
    gates = pl.BlockSpec((None, None, length), lambda b, h, i, j: (b, h, 0))
    return pl.pallas_call(
        functools.partial(_scan_kernel, chunk_size=config.chunk_size, scale=config.scale,
                          reverse=reverse, dk=dk, dv=dv, dtype=chunking.compute_dtype(keys)),
        grid=(batch, heads, dv_pad // block_v, dk_pad // block_k),
        in_specs=[pl.BlockSpec((None, length, None, block_k), lambda b, h, i, j: (b, 0, h, j)),
                  pl.BlockSpec((None, length, None, block_v), lambda b, h, i, j: (b, 0, h, i)),
                  gates, gates, state],
        out_specs=[pl.BlockSpec((None, None, num_chunks, block_v, block_k),
                                lambda b, h, i, j: (b, h, 0, i, j)), state],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, num_chunks, dv_pad, dk_pad), states_dtype),
                   jax.ShapeDtypeStruct((batch, heads, dv_pad, dk_pad), jnp.float32)],
        **compiler(config, "gla_state_cotangents" if reverse else "gla_states", sequential=True),
    )(keys, values, g, seg, init)


def chunk_specs(chunk_size: int):
    """BlockSpec makers for grids (B, H, N[, tile]): a chunk's token rows of a (B, T, H, D)
    array, `columns` wide (tiled along the grid's last axis if `tiled`), and its gates of a
    (B, H, T) array."""
    tokens = lambda columns, tiled=False: pl.BlockSpec(
        (None, chunk_size, None, columns), lambda b, h, n, *i: (b, n, h, i[0] if tiled else 0))
    return tokens, pl.BlockSpec((None, None, chunk_size), lambda b, h, n, *i: (b, h, n))


def output(q, k, v, g, seg, S_in, config):
    """o (B, T, H, Dv) in v's dtype."""
    chunk_size, scale, block = config.chunk_size, config.scale, config.block
    batch, length, heads, dk, dv, dk_pad, dv_pad, block_v, _ = sizes(q, v, block)
    tokens, gates = chunk_specs(chunk_size)
    values = tokens(block_v, tiled=True)
    return pl.pallas_call(
        functools.partial(_output_kernel, scale=scale, dk=dk, dv=dv,
                          dtype=chunking.compute_dtype(q)),
        grid=(batch, heads, length // chunk_size, dv_pad // block_v),
        in_specs=[tokens(dk_pad), tokens(dk_pad), values, gates, gates,
                  pl.BlockSpec((None, None, None, block_v, dk_pad),
                               lambda b, h, n, i: (b, h, n, i, 0))],
        out_specs=values,
        out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        **compiler(config, "gla_output"),
    )(q, k, v, g, seg, S_in)


def _gradients(q, k, v, do, g, seg, S_in, dS_out, config):
    """dq, dk (B, T, H, Dk), dv (B, T, H, Dv) in the inputs' dtypes and dL/dg (B, H, T) float32."""
    chunk_size, scale = config.chunk_size, config.scale
    batch, length, heads, dk, dv, dk_pad, dv_pad, _, _ = sizes(q, v, config.block)
    tokens, gates = chunk_specs(chunk_size)
    state = pl.BlockSpec((None, None, None, dv_pad, dk_pad), lambda b, h, n: (b, h, n, 0, 0))
    return pl.pallas_call(
        functools.partial(_gradients_kernel, scale=scale, dk=dk, dv=dv,
                          dtype=chunking.compute_dtype(q)),
        grid=(batch, heads, length // chunk_size),
        in_specs=[tokens(dk_pad), tokens(dk_pad), tokens(dv_pad), tokens(dv_pad), gates, gates,
                  state, state],
        out_specs=[tokens(dk_pad), tokens(dk_pad), tokens(dv_pad), gates],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(g.shape, jnp.float32)],
        **compiler(config, "gla_gradients"),
    )(q, k, v, do, g, seg, S_in, dS_out)


def pad_state(S, dv_pad: int, dk_pad: int):
    return chunking.pad_axis(chunking.pad_axis(S, -2, dv_pad), -1, dk_pad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gla(q, k, v, g, seg, S0, config):
    return _gla_fwd(q, k, v, g, seg, S0, config)[0]


def _gla_fwd(q, k, v, g, seg, S0, config):
    dk, dv = q.shape[-1], v.shape[-1]
    S0 = pad_state(S0, width(dv), width(dk))
    S_in, S = _scan(k, v, g, seg, S0, config, reverse=False,
                    states_dtype=chunking.compute_dtype(k))
    o = output(q, k, v, g, seg, S_in, config)
    return (o, S[..., :dv, :dk]), (q, k, v, g, seg, S0)


def _gla_bwd(config, residuals, cotangents):
    config = config.backward()
    q, k, v, g, seg, S0 = residuals
    do, dS = cotangents
    dv_pad, dk_pad = S0.shape[-2:]
    S_in, _ = _scan(k, v, g, seg, S0, config, reverse=False)
    dS_out, dS0 = _scan(q, do.astype(v.dtype), g, seg, pad_state(dS, dv_pad, dk_pad), config,
                        reverse=True)
    dq, dk_, dv_, dg = _gradients(q, k, v, do.astype(v.dtype), g, seg, S_in, dS_out, config)
    return dq, dk_, dv_, dg, None, dS0[..., :v.shape[-1], :q.shape[-1]]


_gla.defvjp(_gla_fwd, _gla_bwd)


def gla_pallas_gpu(q, k, v, log_alpha, S0, reset, *, scale: float,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, interpret: bool = False,
                   block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_NUM_WARPS,
                   num_stages: int = DEFAULT_NUM_STAGES, backward_num_warps: int | None = None):
    """Pallas GPU backend; same arguments and returns as `gla_reference` (`kernels.gla.naive`),
    o in v's dtype.

    chunk_size: tokens per chunk, a power of two of at least 16 on a GPU (Triton's matrix
    multiplies need 16 rows; in interpret mode any positive size). block: rows and columns of
    the state tiles of the scans over chunks (forward and reverse); num_stages: their load pipelining
    depth; num_warps: warps per program of the forward's kernels, backward_num_warps of the
    backward's (None: num_warps). interpret=True runs the kernels in Pallas interpret mode on
    any platform.
    """
    config = make_config(chunk_size, scale, block, num_warps, num_stages, interpret,
                         backward_num_warps)
    length = q.shape[1]
    (q, k, v), g, seg = chunk_inputs((q, k, v), log_alpha, reset, chunk_size)
    o, S = _gla(q, k, v, g, seg, S0, config)
    return o[:, :length], S


def make_config(chunk_size, scale, block, num_warps, num_stages, interpret,
                backward_num_warps=None) -> Config:
    """The `Config` of a call of the Pallas GPU chunked backends (GLA, gated delta rule), its
    options checked: ValueError naming the bad one."""
    validation.check_platform("pallas_gpu", "gpu", interpret)
    backward_num_warps = num_warps if backward_num_warps is None else backward_num_warps
    for name, warps in (("num_warps", num_warps), ("backward_num_warps", backward_num_warps)):
        if not (isinstance(warps, int) and 0 < warps <= 32 and not warps & (warps - 1)):
            raise ValueError(f"{name} must be a power of two from 1 to 32, got {warps!r}")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not interpret and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise ValueError("chunk_size must be a power of two of at least 16 for pallas_gpu on a "
                         f"GPU, got {chunk_size}")
    if not (isinstance(block, int) and block >= 16 and not block & (block - 1)):
        raise ValueError(f"block must be a power of two of at least 16, got {block!r}")
    return Config(chunk_size, scale, block, num_warps, num_stages, interpret, backward_num_warps)


def chunk_inputs(tokens, log_alpha, reset, chunk_size: int):
    """The (B, T, H, ...) arrays `tokens` padded to whole chunks, and the gates the kernels take:
    g, the chunk-local cumulative sum of log_alpha, and seg, the chunk-local count of resets,
    both (B, H, T') with T' the padded length."""
    batch, length, heads = log_alpha.shape
    padded = chunking.round_up(length, chunk_size)
    tokens = tuple(chunking.pad_axis(x, 1, padded) for x in tokens)
    log_alpha, reset = chunking.pad_axis(log_alpha, 1, padded), chunking.pad_axis(reset, 1, padded)
    per_chunk = lambda x: x.reshape(batch, padded // chunk_size, chunk_size, heads)
    g = jnp.cumsum(per_chunk(log_alpha), axis=2)
    seg = jnp.cumsum(per_chunk(reset.astype(jnp.int32)), axis=2)
    to_heads = lambda x: jnp.moveaxis(x.reshape(batch, padded, heads), 1, 2)   # (B, H, T')
    return tokens, to_heads(g), to_heads(seg)
