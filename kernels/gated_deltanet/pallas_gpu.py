"""Pallas GPU (Triton) chunked gated delta rule, forward and backward, with tensor-core matrix
multiplies.

Notation of `kernels.gated_deltanet.chunk` and `kernels.gla.pallas_gpu` (g, seg, decay,
from_start, to_end, carry of a chunk of C tokens). Per (batch, head) and chunk, in the WY form:

    A = strictly_lower(beta ⊙ decay ⊙ K Kᵀ),   T = (Id + A)⁻¹,
    W = T (beta ⊙ from_start ⊙ K),   U~ = T (beta ⊙ V),
    U = U~ - W S_inᵀ,   S_out = carry S_in + (to_end ⊙ U)ᵀ K,
    o = scale [from_start ⊙ (Q S_inᵀ) + (QKᵀ ⊙ decay) U]      (GLA's output with values U).

Kernel launches, each a `pallas_call`:

  prepare      grid (B, H, N): T by block inversion in log2(C) doublings of matrix
               multiplies (`_unit_lower_inverse`), W, U~.
  states       `_scan_kernel` forward, grid (B, H, Dv tiles), the chunks walked in order: S_in
               of every chunk, U, and the final state.
  output       `kernels.gla.pallas_gpu.output` with values U.

The backward recomputes prepare (keeping T) and states, then

  local        grid (B, H, N, Dv tiles): dU_local = scale (QKᵀ ⊙ decay)ᵀ dO.
  cotangents   `_scan_kernel` in reverse, the chunks walked backwards: dS_out of every chunk,
               dU = dU_local + to_end ⊙ (K dS_outᵀ), dS_in = carry dS_out - dUᵀ W
               + scale (from_start ⊙ dO)ᵀ Q, and dS_0.
  gradients    two launches: `_state_gradients_kernel`, grid (B, H, N, Dk tiles), what flows
               through the output and the states (dq, a partial dk, dW = -dU S_in); then
               `_wy_gradients_kernel`, grid (B, H, N), what flows through U~, W and T (dv,
               dbeta, the rest of dk), and each's share of dL/dg.

Only the inputs are saved for the backward. As in `kernels.gla.pallas_gpu`, g is the
chunk-local cumulative sum of log_alpha (XLA's, differentiated by autodiff), feature axes are
padded inside the kernels to powers of two (at least 16) and T to whole chunks, 16-bit inputs
multiply in 16 bits with float32 sums (the T doublings in TF32), float32 inputs in IEEE float32,
and states are carried in float32 (the forward stores each chunk's entering state in the compute
dtype for the output kernel, as `kernels.gla.pallas_gpu` does).

Causality whatever the values: prepare replaces non-finite k, v, beta and g by 0 and sets W and
U~ to NaN from the first bad token of the chunk on (U~ per value column for a bad v); U carries
the NaN into the state, hence into every later chunk, and the output kernel keeps it out of
earlier outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from palimpsa_jax.kernels import chunking
from palimpsa_jax.kernels.gla import pallas_gpu as gla

DEFAULT_CHUNK_SIZE = 32   # H200, bf16 (benchmarks/RESULTS.md, 2026-12-03): fwd+bwd 2.9-3.0 ms against
                          # 3.8 at C = 64 at Gated DeltaNet's layer shape, equal at the LM shape
DEFAULT_BLOCK = 64          # value columns per program of the scans and the local cotangents
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2

_F32 = jnp.float32


def _unit_lower_inverse(L, exact: bool):
    """(Id + L)⁻¹ for a strictly lower-triangular (n, n) float32 L, by block inversion with
    masks (no slicing of registers): with X the inverse of the block diagonal of Id + L in blocks
    of b, the blocks of 2b have the inverse X - X L_b X, L_b the part of L below the diagonal
    blocks of b inside those of 2b (exact: (X L_b)² = 0). From X = Id, ceil(log2(n)) doublings
    of two float32 matrix multiplies each: for 16-bit inputs TF32 on a GPU (operands rounded to
    10 mantissa bits, finer than the 16-bit rounding of the products that then use T), unrolled;
    if `exact`, IEEE, in a loop (unrolled, Triton's IEEE products, FMA code, took minutes to
    compile)."""
    precision = jax.lax.Precision.HIGHEST if exact else None
    mm = lambda a, b: jax.lax.dot(a, b, precision=precision, preferred_element_type=_F32)
    size = L.shape[0]
    rows, columns = jnp.arange(size)[:, None], jnp.arange(size)[None, :]

    def double(step, X):
        block = 1 << step
        pair = (rows // (2 * block) == columns // (2 * block)) & (rows // block > columns // block)
        return X - mm(X, mm(jnp.where(pair, L, 0.0), X))

    X, steps = (rows == columns).astype(_F32), (size - 1).bit_length()
    if exact:
        return jax.lax.fori_loop(0, steps, double, X)
    for step in range(steps):
        X = double(step, X)
    return X


def _prepare_kernel(k_ref, v_ref, beta_ref, g_ref, seg_ref, w_ref, u_ref, *T_ref, block_v, dk, dv,
                    dtype):
    """One (b, h, chunk) program: W and U~ of the chunk (U~ `block_v` value columns at a time),
    and T (C, C) float32 if T_ref is given."""
    k_mask = gla.masks(k_ref.shape[-1], dk)
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
    k = gla.load_rows(k_ref, k_mask, _F32)
    g, seg, beta = g_ref[...], seg_ref[...], beta_ref[...]
    size = g.shape[0]
    bad = ((jnp.sum(jnp.where(jnp.isfinite(k), 0, 1), axis=1) > 0) | ~jnp.isfinite(beta)
           | ~jnp.isfinite(g)).astype(jnp.int32)
    k, g, beta = finite(k), finite(g), finite(beta)
    decay, _, from_start, _, _ = gla.gates(g, seg, g_ref[size - 1], seg_ref[size - 1])
    token = jnp.arange(size)
    L = jnp.where(token[:, None] > token[None, :],
                  beta[:, None] * decay * gla.dot(k, k, (1, 1), dtype), 0.0)
    T = _unit_lower_inverse(L, exact=dtype == _F32)
    W = gla.dot(T, (beta * from_start)[:, None] * k, (1, 0), dtype)
    plgpu.store(w_ref, jnp.where(jnp.cumsum(bad)[:, None] > 0, jnp.nan, W).astype(w_ref.dtype),
                mask=k_mask[None, :])
    for tile in range(v_ref.shape[-1] // block_v):
        columns = pl.ds(tile * block_v, block_v)
        v_mask = tile * block_v + jnp.arange(block_v) < dv
        v = gla.load_rows(v_ref.at[:, columns], v_mask, _F32)
        bad_values = jnp.maximum(bad[:, None], jnp.where(jnp.isfinite(v), 0, 1))
        U = gla.dot(T, beta[:, None] * finite(v), (1, 0), dtype)
        plgpu.store(u_ref.at[:, columns], jnp.where(jnp.cumsum(bad_values, axis=0) > 0, jnp.nan, U)
                    .astype(u_ref.dtype), mask=v_mask[None, :])
    if T_ref:
        T_ref[0][...] = T


def _scan_kernel(*refs, chunk_size, scale, reverse, dk, dv, dtype):
    """One (b, h, v-tile) program of a scan over the chunks carrying a (block_v, Dk) tile X;
    stores X as it enters each chunk and the chunk's R.

    Forward, refs (W, K, U~, g, seg, S_0; S_in, U, S_T): X is the state S,
        R = U~ - W Xᵀ (that is U),   X = carry X + (to_end ⊙ R)ᵀ K.
    Reverse, refs (K, W, dU_local, g, seg, dS_T, Q, dO; dS_out, dU, dS_0): X is the cotangent
    of the state leaving the chunk,
        R = dU_local + to_end ⊙ (K Xᵀ) (that is dU),   X = carry X - Rᵀ W + scale (from_start ⊙ dO)ᵀ Q.
    """
    rows_ref, keys_ref, base_ref, g_ref, seg_ref, init_ref = refs[:6]
    q_ref, do_ref = refs[6:8] if reverse else (None, None)
    each_ref, r_ref, last_ref = refs[-3:]
    num_chunks, block_v, _ = each_ref.shape
    k_mask, v_mask = gla.masks(rows_ref.shape[-1], dk), gla.masks(block_v, dv, 2)

    def chunk(r, X):
        n = num_chunks - 1 - r if reverse else r
        each_ref[n] = X.astype(each_ref.dtype)
        start = n * chunk_size
        rows = pl.ds(start, chunk_size)
        _, _, from_start, to_end, carry = gla.gates(*gla.chunk_gates(g_ref, seg_ref, start,
                                                                     chunk_size))
        product = gla.dot(gla.load_rows(rows_ref.at[rows], k_mask), X, (1, 1), dtype)
        base = gla.load_rows(base_ref.at[rows], v_mask, _F32)
        keys = gla.load_rows(keys_ref.at[rows], k_mask)
        if reverse:
            R = base + to_end[:, None] * product
            do = gla.load_rows(do_ref.at[rows], v_mask, _F32)
            X = (carry * X - gla.dot(R, keys, (0, 0), dtype)
                 + gla.dot(scale * from_start[:, None] * do,
                           gla.load_rows(q_ref.at[rows], k_mask), (0, 0), dtype))
        else:
            R = (base - product).astype(r_ref.dtype).astype(_F32)
            X = carry * X + gla.dot(to_end[:, None] * R, keys, (0, 0), dtype)
        plgpu.store(r_ref.at[rows], R.astype(r_ref.dtype), mask=v_mask[None, :])
        return X

    last_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, init_ref[...])


def _local_kernel(q_ref, k_ref, do_ref, g_ref, seg_ref, du_ref, *, scale, dk, dv, dtype):
    """One (b, h, chunk, v-tile) program: dU_local = scale (QKᵀ ⊙ decay)ᵀ dO of the chunk."""
    k_mask, v_mask = gla.masks(q_ref.shape[-1], dk), gla.masks(do_ref.shape[-1], dv, 3)
    g, seg = g_ref[...], seg_ref[...]
    last = g.shape[0] - 1
    decay, same, _, _, _ = gla.gates(g, seg, g_ref[last], seg_ref[last])
    q, k = gla.load_rows(q_ref, k_mask), gla.load_rows(k_ref, k_mask)
    scores = jnp.where(same, gla.dot(q, k, (1, 1), dtype) * decay, 0.0)
    du = scale * gla.dot(scores, gla.load_rows(do_ref, v_mask), (0, 0), dtype)
    plgpu.store(du_ref, du, mask=v_mask[None, :])


def _state_gradients_kernel(q_ref, k_ref, do_ref, g_ref, seg_ref, u_ref, du_ref, S_in_ref,
                            dS_out_ref, dq_ref, dk_ref, dw_ref, dg_ref, *, scale, block_v, dk, dv,
                            dtype):
    """One (b, h, chunk, k-tile) program: what flows through the output and the states, for a
    tile of the key axis. With dU the cotangent of U (from the reverse scan):

      dQKᵀ = scale (dO Uᵀ) ⊙ decay,   dq = dQKᵀ K + scale from_start ⊙ (dO S_in),
      dk = dQKᵀᵀ Q + to_end ⊙ (U dS_out),   dW = -dU S_in,

    and the tile's share of dL/dg (through decay, from_start, to_end and carry). dk is the
    partial gradient that `_wy_gradients_kernel` completes. The value axis is walked `block_v`
    columns at a time."""
    size, width_k = q_ref.shape
    k_mask = gla.masks(width_k, dk, 3)
    g, seg = g_ref[...], seg_ref[...]
    last = size - 1
    decay, same, from_start, to_end, carry = gla.gates(g, seg, g_ref[last], seg_ref[last])
    q, k = gla.load_rows(q_ref, k_mask), gla.load_rows(k_ref, k_mask)
    dq_state = dk_state = dW = jnp.zeros((size, width_k), _F32)
    dP, through_carry = jnp.zeros((size, size), _F32), 0.0
    for tile in range(u_ref.shape[-1] // block_v):
        columns = pl.ds(tile * block_v, block_v)
        v_mask = tile * block_v + jnp.arange(block_v) < dv
        do, u = (gla.load_rows(ref.at[:, columns], v_mask) for ref in (do_ref, u_ref))
        du = gla.load_rows(du_ref.at[:, columns], v_mask, _F32)
        S_in, dS_out = S_in_ref[columns, :], dS_out_ref[columns, :]
        dq_state += gla.dot(do, S_in, (1, 0), dtype)
        dP += gla.dot(do, u, (1, 1), dtype)
        dk_state += gla.dot(u, dS_out, (1, 0), dtype)
        dW -= gla.dot(du, S_in, (1, 0), dtype)
        through_carry += jnp.sum(dS_out * S_in)
    q32, k32 = q.astype(_F32), k.astype(_F32)
    dq_state = (scale * from_start)[:, None] * dq_state
    dk_state = to_end[:, None] * dk_state
    dQK = jnp.where(same, scale * dP * decay, 0.0)
    exponents = dQK * gla.dot(q, k, (1, 1), dtype)      # cotangents of g_t - g_s
    dg = (jnp.sum(exponents, axis=1) - jnp.sum(exponents, axis=0)
          + jnp.sum(q32 * dq_state, axis=1) - jnp.sum(k32 * dk_state, axis=1))
    through_end = carry * through_carry + jnp.sum(k32 * dk_state)
    dg_ref[...] = jnp.where(jnp.arange(size) == last, dg + through_end, dg)
    dq = gla.dot(dQK, k, (1, 0), dtype) + dq_state
    plgpu.store(dq_ref, dq.astype(dq_ref.dtype), mask=k_mask[None, :])
    plgpu.store(dk_ref, gla.dot(dQK, q, (0, 0), dtype) + dk_state, mask=k_mask[None, :])
    plgpu.store(dw_ref, dW, mask=k_mask[None, :])


def _wy_gradients_kernel(k_ref, v_ref, beta_ref, g_ref, seg_ref, T_ref, du_ref, dw_ref,
                         dk_state_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, *, block_k, block_v, dk,
                         dv, dtype):
    """One (b, h, chunk) program: what flows through U~ = T (beta ⊙ V), W = T (beta ⊙ from_start
    ⊙ K) and T = (Id + A)⁻¹, completing dk (from `_state_gradients_kernel`'s partial dk_state):

      dv = beta ⊙ (Tᵀ dU),   dk += beta from_start ⊙ (Tᵀ dW),
      dT = dU (beta ⊙ V)ᵀ + dW (beta ⊙ from_start ⊙ K)ᵀ,
      dA = -Tᵀ dT Tᵀ (strictly lower, in one segment),   with dD = dA ⊙ decay (A = beta ⊙ D ⊙ KKᵀ):
      dk += beta ⊙ (dD K) + dDᵀ (beta ⊙ K),

    and dbeta and this part of dL/dg, whose K Kᵀ terms are k_t·(dD K)_t and k_s·(dDᵀ (beta K))_s
    (no C x C Gram matrix in registers). The value and key axes are walked `block_v` and
    `block_k` columns at a time (the key axis twice: for dT, then for dk)."""
    size = g_ref.shape[0]
    g, seg, beta, T = g_ref[...], seg_ref[...], beta_ref[...], T_ref[...]
    last = size - 1
    decay, same, from_start, _, _ = gla.gates(g, seg, g_ref[last], seg_ref[last])
    beta_from_start = beta * from_start
    dT, dbeta = jnp.zeros((size, size), _F32), jnp.zeros((size,), _F32)
    for tile in range(v_ref.shape[-1] // block_v):
        columns = pl.ds(tile * block_v, block_v)
        v_mask = tile * block_v + jnp.arange(block_v) < dv
        v, du = (gla.load_rows(ref.at[:, columns], v_mask, _F32) for ref in (v_ref, du_ref))
        T_du = gla.dot(T, du, (0, 0), dtype)
        dbeta += jnp.sum(v * T_du, axis=1)
        dT += gla.dot(du, beta[:, None] * v, (1, 1), dtype)
        plgpu.store(dv_ref.at[:, columns], (beta[:, None] * T_du).astype(dv_ref.dtype),
                    mask=v_mask[None, :])

    def key_tiles():
        """(columns, mask, k, dW, Tᵀ dW) of each tile of the key axis."""
        for tile in range(k_ref.shape[-1] // block_k):
            columns = pl.ds(tile * block_k, block_k)
            k_mask = tile * block_k + jnp.arange(block_k) < dk
            k = gla.load_rows(k_ref.at[:, columns], k_mask, _F32)
            dW = gla.load_rows(dw_ref.at[:, columns], k_mask, _F32)
            yield columns, k_mask, k, dW, gla.dot(T, dW, (0, 0), dtype)

    k_dx_w = jnp.zeros((size,), _F32)
    for _, _, k, dW, dx_w in key_tiles():
        dT += gla.dot(dW, beta_from_start[:, None] * k, (1, 1), dtype)
        k_dx_w += jnp.sum(k * dx_w, axis=1)
    token = jnp.arange(size)
    dD = jnp.where(same & (token[:, None] > token[None, :]),
                   -gla.dot(gla.dot(T, dT, (0, 0), dtype), T, (1, 1), dtype) * decay, 0.0)
    dbeta += from_start * k_dx_w
    dg = beta_from_start * k_dx_w
    for columns, k_mask, k, _, dx_w in key_tiles():
        rows_term = gla.dot(dD, k, (1, 0), dtype)                      # dD K
        columns_term = gla.dot(dD, beta[:, None] * k, (0, 0), dtype)   # dDᵀ (beta ⊙ K)
        k_rows, k_columns = jnp.sum(k * rows_term, axis=1), jnp.sum(k * columns_term, axis=1)
        dbeta += k_rows
        dg += beta * k_rows - k_columns                 # through the decays' g_t - g_s
        dk_ = (gla.load_rows(dk_state_ref.at[:, columns], k_mask, _F32)
               + beta_from_start[:, None] * dx_w + beta[:, None] * rows_term + columns_term)
        plgpu.store(dk_ref.at[:, columns], dk_.astype(dk_ref.dtype), mask=k_mask[None, :])
    dbeta_ref[...] = dbeta
    dg_ref[...] = dg


def _prepare(k, v, beta, g, seg, config, *, with_T: bool):
    """W (B, T, H, Dk), U~ (B, T, H, Dv) in the compute dtype and, if with_T, T (B, H, N, C, C)
    float32 (else None)."""
    batch, length, heads, dk, dv, dk_pad, dv_pad, block_v, _ = gla.sizes(k, v, config.block)
    chunk_size, dtype = config.chunk_size, chunking.compute_dtype(k)
    num_chunks = length // chunk_size
    tokens, gates = gla.chunk_specs(chunk_size)
    out_specs = [tokens(dk_pad), tokens(dv_pad)]
    out_shape = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    if with_T:
        out_specs.append(pl.BlockSpec((None, None, None, chunk_size, chunk_size),
                                      lambda b, h, n: (b, h, n, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, num_chunks, chunk_size, chunk_size),
                                              _F32))
    W, U_tilde, *T = pl.pallas_call(
        functools.partial(_prepare_kernel, block_v=block_v, dk=dk, dv=dv, dtype=dtype),
        grid=(batch, heads, num_chunks),
        in_specs=[tokens(dk_pad), tokens(dv_pad), gates, gates, gates],
        out_specs=out_specs, out_shape=out_shape,
        **gla.compiler(config, "gated_delta_prepare"),
    )(k, v, beta, g, seg)
    return (T[0] if with_T else None), W, U_tilde


def _scan(rows, keys, base, g, seg, init, config, *, reverse: bool, extra=(),
          states_dtype=_F32):
    """`_scan_kernel` over every (b, h) and value tile: rows, keys (B, T, H, Dk), base
    (B, T, H, Dv), init (B, H, Dv', Dk') float32, extra (Q, dO) in reverse. Returns the tile
    entering each chunk (B, H, N, Dv', Dk') in `states_dtype`, R (B, T, H, Dv) (U in the compute
    dtype, or dU float32) and the last tile (B, H, Dv', Dk') float32."""
    batch, length, heads, dk, dv, dk_pad, dv_pad, block_v, _ = gla.sizes(rows, base,
                                                                          config.block)
    num_chunks = length // config.chunk_size
    keys_spec = pl.BlockSpec((None, length, None, dk_pad), lambda b, h, i: (b, 0, h, 0))
    values_spec = pl.BlockSpec((None, length, None, block_v), lambda b, h, i: (b, 0, h, i))
    gates = pl.BlockSpec((None, None, length), lambda b, h, i: (b, h, 0))
    state = pl.BlockSpec((None, None, block_v, dk_pad), lambda b, h, i: (b, h, i, 0))
    dtype = chunking.compute_dtype(rows)
    return pl.pallas_call(
        functools.partial(_scan_kernel, chunk_size=config.chunk_size, scale=config.scale,
                          reverse=reverse, dk=dk, dv=dv, dtype=dtype),
        grid=(batch, heads, dv_pad // block_v),
        in_specs=[keys_spec, keys_spec, values_spec, gates, gates, state]
                 + ([keys_spec, values_spec] if reverse else []),
        out_specs=[pl.BlockSpec((None, None, num_chunks, block_v, dk_pad),
                                lambda b, h, i: (b, h, 0, i, 0)), values_spec, state],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, num_chunks, dv_pad, dk_pad), states_dtype),
                   jax.ShapeDtypeStruct(base.shape, _F32 if reverse else dtype),
                   jax.ShapeDtypeStruct((batch, heads, dv_pad, dk_pad), _F32)],
        **gla.compiler(config, "gated_delta_state_cotangents" if reverse else "gated_delta_states",
                       sequential=True),
    )(rows, keys, base, g, seg, init, *extra)


def _local(q, k, do, g, seg, config):
    """dU_local (B, T, H, Dv) float32."""
    batch, length, heads, dk, dv, dk_pad, dv_pad, block_v, _ = gla.sizes(q, do, config.block)
    tokens, gates = gla.chunk_specs(config.chunk_size)
    return pl.pallas_call(
        functools.partial(_local_kernel, scale=config.scale, dk=dk, dv=dv,
                          dtype=chunking.compute_dtype(q)),
        grid=(batch, heads, length // config.chunk_size, dv_pad // block_v),
        in_specs=[tokens(dk_pad), tokens(dk_pad), tokens(block_v, tiled=True), gates, gates],
        out_specs=tokens(block_v, tiled=True),
        out_shape=jax.ShapeDtypeStruct(do.shape, _F32),
        **gla.compiler(config, "gated_delta_local_cotangents"),
    )(q, k, do, g, seg)


def _gradients(q, k, v, beta, do, g, seg, T, U, dU, S_in, dS_out, config):
    """dq, dk (B, T, H, Dk), dv (B, T, H, Dv) in the inputs' dtypes; dbeta and dg (B, H, T)
    float32: `_state_gradients_kernel` over (b, h, chunk, k-tile), then `_wy_gradients_kernel`
    over (b, h, chunk)."""
    batch, length, heads, dk, dv, dk_pad, dv_pad, block_v, block_k = gla.sizes(q, v,
                                                                                config.block)
    chunk_size, dtype = config.chunk_size, chunking.compute_dtype(q)
    num_chunks, k_tiles = length // chunk_size, dk_pad // block_k
    tokens, gates = gla.chunk_specs(chunk_size)
    state = pl.BlockSpec((None, None, None, dv_pad, block_k), lambda b, h, n, j: (b, h, n, 0, j))
    partial_k = jax.ShapeDtypeStruct(q.shape, _F32)
    dq, dk_state, dW, dg_state = pl.pallas_call(
        functools.partial(_state_gradients_kernel, scale=config.scale, block_v=block_v, dk=dk,
                          dv=dv, dtype=dtype),
        grid=(batch, heads, num_chunks, k_tiles),
        in_specs=[tokens(block_k, tiled=True), tokens(block_k, tiled=True), tokens(dv_pad),
                  gates, gates, tokens(dv_pad), tokens(dv_pad), state, state],
        out_specs=[tokens(block_k, tiled=True)] * 3
                  + [pl.BlockSpec((None, None, None, chunk_size), lambda b, h, n, j: (b, h, j, n))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), partial_k, partial_k,
                   jax.ShapeDtypeStruct((batch, heads, k_tiles, length), _F32)],
        **gla.compiler(config, "gated_delta_state_gradients"),
    )(q, k, do, g, seg, U, dU, S_in, dS_out)
    dk_, dv_, dbeta, dg_wy = pl.pallas_call(
        functools.partial(_wy_gradients_kernel, block_k=block_k, block_v=block_v, dk=dk, dv=dv, dtype=dtype),
        grid=(batch, heads, num_chunks),
        in_specs=[tokens(dk_pad), tokens(dv_pad), gates, gates, gates,
                  pl.BlockSpec((None, None, None, chunk_size, chunk_size),
                               lambda b, h, n: (b, h, n, 0, 0)),
                  tokens(dv_pad), tokens(dk_pad), tokens(dk_pad)],
        out_specs=[tokens(dk_pad), tokens(dv_pad), gates, gates],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(beta.shape, _F32), jax.ShapeDtypeStruct(g.shape, _F32)],
        **gla.compiler(config, "gated_delta_wy_gradients"),
    )(k, v, beta, g, seg, T, dU, dW, dk_state)
    return dq, dk_, dv_, dbeta, dg_wy + jnp.sum(dg_state, axis=2)


def _states(k, v, beta, g, seg, S0, config, *, backward: bool):
    """T (the backward's, else None), W, and the states pass: S_in of every chunk, U and the
    final state. S_in is float32 for the backward's gradients; for the forward's output kernel,
    which multiplies it in the compute dtype, it is stored in that dtype (the same output, half
    the memory traffic for 16-bit inputs)."""
    T, W, U_tilde = _prepare(k, v, beta, g, seg, config, with_T=backward)
    states_dtype = _F32 if backward else chunking.compute_dtype(k)
    return (T, W, *_scan(W, k, U_tilde, g, seg, S0, config, reverse=False,
                         states_dtype=states_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _gated_delta(q, k, v, beta, g, seg, S0, config):
    return _gated_delta_fwd(q, k, v, beta, g, seg, S0, config)[0]


def _gated_delta_fwd(q, k, v, beta, g, seg, S0, config):
    dk, dv = q.shape[-1], v.shape[-1]
    S0 = gla.pad_state(S0, gla.width(dv), gla.width(dk))
    _, _, S_in, U, S = _states(k, v, beta, g, seg, S0, config, backward=False)
    o = gla.output(q, k, U, g, seg, S_in, config).astype(v.dtype)
    return (o, S[..., :dv, :dk]), (q, k, v, beta, g, seg, S0)


def _gated_delta_bwd(config, residuals, cotangents):
    config = config.backward()
    q, k, v, beta, g, seg, S0 = residuals
    do, dS = cotangents
    do = do.astype(v.dtype)
    dv_pad, dk_pad = S0.shape[-2:]
    T, W, S_in, U, _ = _states(k, v, beta, g, seg, S0, config, backward=True)
    dS_out, dU, dS0 = _scan(k, W, _local(q, k, do, g, seg, config), g, seg,
                            gla.pad_state(dS, dv_pad, dk_pad), config, reverse=True,
                            extra=(q, do))
    dq, dk, dv, dbeta, dg = _gradients(q, k, v, beta, do, g, seg, T, U, dU, S_in, dS_out, config)
    return dq, dk, dv, dbeta, dg, None, dS0[..., :v.shape[-1], :q.shape[-1]]


_gated_delta.defvjp(_gated_delta_fwd, _gated_delta_bwd)


def gated_delta_pallas_gpu(q, k, v, beta, log_alpha, S0, reset, *, scale: float,
                           chunk_size: int = DEFAULT_CHUNK_SIZE, interpret: bool = False,
                           block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_NUM_WARPS,
                           num_stages: int = DEFAULT_NUM_STAGES,
                           backward_num_warps: int | None = None):
    """Pallas GPU backend; same arguments and returns as `gated_delta_reference`
    (`kernels.gated_deltanet.naive`), o in v's dtype.

    chunk_size: tokens per chunk, a power of two of at least 16 on a GPU (in interpret mode any
    positive size). block: value columns per program of the scans over chunks and of the local
    cotangents, and per step of the gradients kernel; num_stages: the scans' load pipelining
    depth; num_warps: warps per program of the forward's kernels, backward_num_warps of the
    backward's (which recomputes the forward's; None: num_warps). interpret=True runs the
    kernels in Pallas interpret mode on any platform.
    """
    config = gla.make_config(chunk_size, scale, block, num_warps, num_stages, interpret,
                             backward_num_warps)
    length = q.shape[1]
    (q, k, v, beta), g, seg = gla.chunk_inputs((q, k, v, beta), log_alpha, reset, chunk_size)
    o, S = _gated_delta(q, k, v, jnp.moveaxis(beta, 1, 2), g, seg, S0, config)
    return o[:, :length], S
