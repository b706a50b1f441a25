"""Pallas GPU (Triton) kernels of the metaplastic recurrence, parallel over chunks in both passes.

Within a chunk, with decay[t, s] and from_start_t of `chunking.chunk_decays`, row v of the
state after token t is

    M_t[v]    = from_start_t M_in[v]    + sum_s decay[t, s] v_s[v] k_s
    Ibar_t[v] = from_start_t Ibar_in[v] + sum_s decay[t, s] beta_s[v] k_s²

one (C x C) @ (C x Dk) matrix multiply per row and state (tensor cores: `dot_algorithm`). The
states entering the chunks (M_in, Ibar_in) come from matrix multiplies and a parallel prefix scan
over chunks, as in chunked GLA, so every (chunk, b, h, row tile) is an independent program: its
per-token states are formed, divided and read out in registers, one row at a time; nothing of
size C·Dv·Dk per chunk reaches HBM.

Backward. Token t's read-out gives the state cotangents directly
gM_t = scale do_t ⊗ q_t / I_t and gI_t = -(scale do_t ⊗ q_t ⊙ mu_t + scale² dvar_t ⊗ q_t² / I_t) / I_t
(`naive.direct_cotangents`); the total cotangents obey G_t = gM_t + alpha_{t+1} G_{t+1}
(H_t likewise with gI). Pass 1, parallel over chunks, sums each chunk's direct cotangents decayed
to its start; a reverse prefix scan over chunks gives the cotangent E_c reaching each chunk's end
from later chunks; pass 2, parallel over chunks, forms G = decayᵀ @ gM + to_end ⊗ E_c per row and
the gradients

    dv_t = G_t k_t,   dbeta_t = H_t k_t²,   dk_t = sum_v G_t[v] v_t[v] + 2 H_t[v] beta_t[v] k_t,
    dq_t = scale sum_v do_t[v] mu_t[v] (+ the variance's term),
    dlog_alpha_t = <G_t, alpha_t M_{t-1}> + <H_t, alpha_t Ibar_{t-1}>
                 = <G_t, M_t> + <H_t, Ibar_t> - v_t · dv_t - beta_t · dbeta_t.

Non-finite inputs are handled as in the other chunked backends (`chunking.finite_inputs`): zeroed
before the matrix multiplies, their outputs set to NaN from the bad token on.
Inputs use the chunk layout (N, B, H, C, ...) of `kernels.chunking`.

Measured on an H200 (benchmarks/RESULTS.md, eleventh and twelfth sessions): correct to 5e-7 in
float32, but slower than the recurrent design at every reference shape (LM shape 3.66 / 13.34 ms
forward / forward+backward against 1.14 / 7.80, both with the MUFU reciprocal); with bfloat16
products (eleventh session) LM 2.66 / 8.98. Forming a whole tile's states with one multiply
(round 2, commit ff5ad56) was slower still. `pallas_gpu` keeps the recurrent design as its
default.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from palimpsa_jax.kernels import chunking
from palimpsa_jax.kernels.gla.pallas_gpu import width
from palimpsa_jax.kernels.palimpsa.naive import direct_cotangents

DEFAULT_CHUNK_SIZE = 16
DEFAULT_BLOCK_V = 16
DEFAULT_NUM_WARPS = 4
DEFAULT_BACKWARD_NUM_WARPS = 4
PRECISIONS = ("float32", "bfloat16")
DEFAULT_PRECISION = "float32"


def dot_algorithm(precision: str, interpret: bool):
    """(operand dtype, precision) of the in-kernel matrix multiplies, which sum in float32.

    "float32": float32 accuracy, on a GPU as three TF32 tensor-core products (TF32x3), in
    interpret mode at HIGHEST precision. "bfloat16": operands rounded to bfloat16, one
    tensor-core product (the states' relative error is then about 2^-9).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bfloat16":
        return jnp.bfloat16, None
    return jnp.float32, (jax.lax.Precision.HIGHEST if interpret
                         else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)


def reciprocal(interpret: bool):
    """1 / x of a float32 array inside a kernel: on a GPU one MUFU instruction (PTX
    `rcp.approx.ftz.f32`, at most 1 ulp from the exact reciprocal) where Triton's division
    `div.full.f32` costs about eight (range checks and selects around the same MUFU); in
    interpret mode the exact division."""
    if interpret:
        return jnp.reciprocal
    return lambda x: plgpu.elementwise_inline_asm(
        "rcp.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]


def dot(a, b, contract: tuple[int, int], algorithm):
    """a · b (2-D) contracting axis contract[0] of a with axis contract[1] of b, float32 sums;
    algorithm from `dot_algorithm`."""
    dtype, precision = algorithm
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype),
                               (((contract[0],), (contract[1],)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def _prepared(chunks, reset):
    """Cleaned float32 chunk inputs, where non-finite ones poison the outputs (N, B, H, C, Dv),
    and the chunk decays: decay (N, B, H, C, C), from_start (N, B, H, C)."""
    q, k, v, beta, log_alpha = (x.astype(jnp.float32) for x in chunks)
    (v, beta), (k, log_alpha), poisoned = chunking.finite_inputs((v, beta), (k, log_alpha))
    decay, from_start = chunking.chunk_decays(log_alpha, reset)
    return (q, k, v, beta), poisoned, decay, from_start


def _chunk_sums(carry, local, init, *, reverse: bool):
    """S_c = carry_c S_{c-1} + local_c over chunks (reverse: from the last chunk back), each
    (N, B, H, Dv, Dk): the value before each chunk, and after the last one."""
    if not reverse:
        return chunking.chunk_states(carry, local, init)
    flip = lambda x: jnp.flip(x, 0)
    before, after = chunking.chunk_states(flip(carry), flip(local), init)
    return flip(before), after


def _entering_states(k, v, beta, decay, from_start, poisoned, state):
    """The (M, Ibar) entering each chunk, each (N, B, H, Dv, Dk), and the final pair: each chunk's
    own end state sum_s to_end_s (v_s ⊗ k_s, beta_s ⊗ k_s²) as a batched matrix multiply (float32),
    carried across chunks by a parallel prefix scan."""
    to_end = decay[..., -1, :, None]
    local = [jnp.einsum("nbhsv,nbhsk->nbhvk", x, to_end * y, precision=jax.lax.Precision.HIGHEST)
             for x, y in ((v, k), (beta, k * k))]
    carry = from_start[..., -1]
    entering = [_chunk_sums(carry, chunking.poison(x, poisoned[..., -1, :]), x0, reverse=False)
                for x, x0 in zip(local, state)]
    return tuple(e for e, _ in entering), tuple(f for _, f in entering)


def _tile(q_ref, v_ref, tile_axis: int, dk: int, dv: int):
    """Masks of a program's (C, Dk') token rows and (C, block_v) value columns, and the first
    state row of its tile."""
    dk_pad, block_v = q_ref.shape[-1], v_ref.shape[-1]
    first = pl.program_id(tile_axis) * block_v
    return jnp.arange(dk_pad) < dk, first + jnp.arange(block_v) < dv, first


def _row_states(j, first, tokens, decay, from_start, state_refs, prior_ref, k_mask, dv,
                algorithm):
    """Row j of the tile: its inputs v_j, beta_j (C,), its states M, Ibar after every token of
    the chunk, each (C, Dk'), and its prior (1, Dk')."""
    k, v, beta = tokens
    pick = jnp.arange(v.shape[-1])[None, :] == j
    column = lambda x: jnp.sum(jnp.where(pick, x, 0.0), axis=1)
    v_j, beta_j = column(v), column(beta)
    mask = k_mask & (first + j < dv)
    M_in, Ibar_in = (plgpu.load(ref.at[j], mask=mask, other=0.0) for ref in state_refs)
    prior = plgpu.load(prior_ref.at[j], mask=mask, other=1.0)
    entering = from_start[:, None]
    M = dot(decay * v_j[None, :], k, (1, 0), algorithm) + entering * M_in[None, :]
    Ibar = dot(decay * beta_j[None, :], k * k, (1, 0), algorithm) + entering * Ibar_in[None, :]
    return v_j, beta_j, M, Ibar, prior[None, :]


def _load_tokens(q_ref, k_ref, v_ref, beta_ref, k_mask, v_mask):
    """q, k (C, Dk') and v, beta (C, block_v) of this program, float32, zero where masked."""
    load = lambda ref, mask: plgpu.load(ref, mask=mask[None, :], other=0.0).astype(jnp.float32)
    return load(q_ref, k_mask), load(k_ref, k_mask), load(v_ref, v_mask), load(beta_ref, v_mask)


def _forward_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, from_start_ref, prior_ref,
                    M_in_ref, Ibar_in_ref, o_ref, var_ref, *, scale: float, dk: int, dv: int,
                    algorithm, reciprocal):
    """One (chunk, b, h, v-tile) program: the chunk's outputs (C, block_v), row by row."""
    k_mask, v_mask, first = _tile(q_ref, v_ref, 3, dk, dv)
    q, k, v, beta = _load_tokens(q_ref, k_ref, v_ref, beta_ref, k_mask, v_mask)
    decay, from_start = decay_ref[...], from_start_ref[...]
    columns = jnp.arange(v.shape[-1])[None, :]

    def row(j, outputs):
        o, var = outputs
        _, _, M, Ibar, prior = _row_states(j, first, (k, v, beta), decay, from_start,
                                           (M_in_ref, Ibar_in_ref), prior_ref, k_mask, dv,
                                           algorithm)
        plasticity = reciprocal(Ibar + prior)
        o = jnp.where(columns == j, scale * jnp.sum(M * plasticity * q, axis=1)[:, None], o)
        if var_ref is not None:
            var_j = scale * scale * jnp.sum(plasticity * q * q, axis=1)
            var = jnp.where(columns == j, var_j[:, None], var)
        return o, var

    zeros = jnp.zeros(v.shape, jnp.float32)
    o, var = jax.lax.fori_loop(0, v.shape[-1], row, (zeros, zeros))
    plgpu.store(o_ref, o, mask=v_mask[None, :])
    if var_ref is not None:
        plgpu.store(var_ref, var, mask=v_mask[None, :])


def _row_cotangents(j, first, q, tokens, decay, from_start, state_refs, prior_ref, d_o, d_var,
                    k_mask, dv, scale, algorithm, reciprocal):
    """Row j's states (`_row_states`), posterior mean and the direct cotangents (gM, gI) of its
    read-outs, each (C, Dk'), and its d_o, d_var (C,)."""
    v_j, beta_j, M, Ibar, prior = _row_states(j, first, tokens, decay, from_start, state_refs,
                                              prior_ref, k_mask, dv, algorithm)
    pick = jnp.arange(d_o.shape[-1])[None, :] == j
    column = lambda x: jnp.sum(jnp.where(pick, x, 0.0), axis=1)
    d_o_j = column(d_o)
    d_var_j = None if d_var is None else column(d_var)
    gM, gI, plasticity, mu = direct_cotangents(
        M, Ibar, prior, q, d_o_j[:, None], None if d_var is None else d_var_j[:, None], scale,
        reciprocal)
    return v_j, beta_j, M, Ibar, plasticity, mu, gM, gI, d_o_j, d_var_j


def _sums_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, from_start_ref, prior_ref, M_in_ref,
                 Ibar_in_ref, d_o_ref, d_var_ref, EM_ref, EI_ref, d_prior_ref, *, scale: float,
                 dk: int, dv: int, algorithm, reciprocal):
    """Pass 1, one (chunk, b, h, v-tile) program: per row, the chunk's direct cotangents decayed
    to its start, sum_t from_start_t (gM_t, gI_t), and its share of dL/dprior, sum_t gI_t."""
    k_mask, v_mask, first = _tile(q_ref, v_ref, 3, dk, dv)
    q, k, v, beta = _load_tokens(q_ref, k_ref, v_ref, beta_ref, k_mask, v_mask)
    d_o = plgpu.load(d_o_ref, mask=v_mask[None, :], other=0.0)
    d_var = None if d_var_ref is None else plgpu.load(d_var_ref, mask=v_mask[None, :], other=0.0)
    decay, from_start = decay_ref[...], from_start_ref[...]

    def row(j, _):
        *_, gM, gI, _, _ = _row_cotangents(j, first, q, (k, v, beta), decay, from_start,
                                           (M_in_ref, Ibar_in_ref), prior_ref, d_o, d_var,
                                           k_mask, dv, scale, algorithm, reciprocal)
        mask = k_mask & (first + j < dv)
        plgpu.store(EM_ref.at[j], jnp.sum(from_start[:, None] * gM, axis=0), mask=mask)
        plgpu.store(EI_ref.at[j], jnp.sum(from_start[:, None] * gI, axis=0), mask=mask)
        plgpu.store(d_prior_ref.at[j], jnp.sum(gI, axis=0), mask=mask)
        return 0

    jax.lax.fori_loop(0, v.shape[-1], row, 0)


def _gradients_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, from_start_ref, prior_ref,
                      M_in_ref, Ibar_in_ref, d_o_ref, d_var_ref, EM_ref, EI_ref,
                      dq_ref, dk_ref, dv_ref, dbeta_ref, d_log_alpha_ref, *, scale: float,
                      dk: int, dv: int, algorithm, reciprocal):
    """Pass 2, one (chunk, b, h, v-tile) program: the total cotangents G, H of every token's
    state, row by row, from the chunk's direct ones and E (the cotangent reaching its end), and
    the inputs' gradients; dq, dk and dlog_alpha are this tile's partial sums over rows."""
    k_mask, v_mask, first = _tile(q_ref, v_ref, 3, dk, dv)
    q, k, v, beta = _load_tokens(q_ref, k_ref, v_ref, beta_ref, k_mask, v_mask)
    d_o = plgpu.load(d_o_ref, mask=v_mask[None, :], other=0.0)
    d_var = None if d_var_ref is None else plgpu.load(d_var_ref, mask=v_mask[None, :], other=0.0)
    decay, from_start = decay_ref[...], from_start_ref[...]
    to_end = jnp.sum(jnp.where(jnp.arange(decay.shape[0])[:, None] == decay.shape[0] - 1, decay,
                               0.0), axis=0)
    columns = jnp.arange(v.shape[-1])[None, :]

    def row(j, sums):
        dq, dk_, d_log_alpha, d_v, d_beta = sums
        v_j, beta_j, M, Ibar, plasticity, mu, gM, gI, d_o_j, d_var_j = _row_cotangents(
            j, first, q, (k, v, beta), decay, from_start, (M_in_ref, Ibar_in_ref), prior_ref,
            d_o, d_var, k_mask, dv, scale, algorithm, reciprocal)
        mask = k_mask & (first + j < dv)
        EM, EI = (plgpu.load(ref.at[j], mask=mask, other=0.0) for ref in (EM_ref, EI_ref))
        G = dot(decay, gM, (0, 0), algorithm) + to_end[:, None] * EM[None, :]
        H = dot(decay, gI, (0, 0), algorithm) + to_end[:, None] * EI[None, :]
        d_v_j = jnp.sum(G * k, axis=1)
        d_beta_j = jnp.sum(H * k * k, axis=1)
        dq = dq + scale * d_o_j[:, None] * mu
        if d_var_j is not None:
            dq = dq + 2 * scale * scale * d_var_j[:, None] * q * plasticity
        dk_ = dk_ + G * v_j[:, None] + 2 * H * beta_j[:, None] * k
        d_log_alpha = (d_log_alpha + jnp.sum(G * M + H * Ibar, axis=1)
                       - v_j * d_v_j - beta_j * d_beta_j)
        d_v = jnp.where(columns == j, d_v_j[:, None], d_v)
        d_beta = jnp.where(columns == j, d_beta_j[:, None], d_beta)
        return dq, dk_, d_log_alpha, d_v, d_beta

    zeros = jnp.zeros(q.shape, jnp.float32)
    columns_zero = jnp.zeros(v.shape, jnp.float32)
    dq, dk_, d_log_alpha, d_v, d_beta = jax.lax.fori_loop(
        0, v.shape[-1], row, (zeros, zeros, jnp.zeros(q.shape[:1], jnp.float32), columns_zero,
                              columns_zero))
    plgpu.store(dq_ref, dq, mask=k_mask[None, :])
    plgpu.store(dk_ref, dk_, mask=k_mask[None, :])
    plgpu.store(dv_ref, d_v, mask=v_mask[None, :])
    plgpu.store(dbeta_ref, d_beta, mask=v_mask[None, :])
    d_log_alpha_ref[...] = d_log_alpha


def _with_variance(kernel, position: int, return_variance: bool):
    """The kernel, or, without the variance, the kernel given None for its d_var (or var) ref at
    `position`."""
    if return_variance:
        return kernel
    return lambda *refs, **kwargs: kernel(*refs[:position], None, *refs[position:], **kwargs)


def _specs(chunk_size: int, dk_pad: int, block_v: int):
    """BlockSpecs over the grid (chunk, b, h, v-tile): token rows (C, Dk'), value columns
    (C, block_v), the chunk's decay (C, C) and from_start (C,), the prior's and a chunk state's
    (block_v, Dk') tile, and a v-tile's partial sums (C, Dk') and (C,)."""
    tokens = pl.BlockSpec((None, None, None, chunk_size, dk_pad), lambda n, b, h, j: (n, b, h, 0, 0))
    values = pl.BlockSpec((None, None, None, chunk_size, block_v), lambda n, b, h, j: (n, b, h, 0, j))
    decay = pl.BlockSpec((None, None, None, chunk_size, chunk_size),
                         lambda n, b, h, j: (n, b, h, 0, 0))
    gates = pl.BlockSpec((None, None, None, chunk_size), lambda n, b, h, j: (n, b, h, 0))
    prior = pl.BlockSpec((None, block_v, dk_pad), lambda n, b, h, j: (h, j, 0))
    state = pl.BlockSpec((None, None, None, block_v, dk_pad), lambda n, b, h, j: (n, b, h, j, 0))
    partial_rows = pl.BlockSpec((None, None, None, None, chunk_size, dk_pad),
                                lambda n, b, h, j: (j, n, b, h, 0, 0))
    partial_gates = pl.BlockSpec((None, None, None, None, chunk_size),
                                 lambda n, b, h, j: (j, n, b, h, 0))
    return tokens, values, decay, gates, prior, state, partial_rows, partial_gates


def _call(kernel, name, grid, in_specs, out_specs, out_shape, num_warps, interpret, **kwargs):
    return pl.pallas_call(
        functools.partial(kernel, **kwargs), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))


def _sizes(chunks, block_v: int):
    """(N, B, H, C, Dk, Dv, Dk padded, the state tile's rows, tiles over Dv)."""
    num_chunks, batch, heads, chunk_size, dk = chunks[0].shape
    dv = chunks[2].shape[-1]
    block_v = min(block_v, pl.next_power_of_2(dv))
    return num_chunks, batch, heads, chunk_size, dk, dv, width(dk), block_v, pl.cdiv(dv, block_v)


def forward(chunks, prior, state, reset, *, scale: float, return_variance: bool,
            interpret: bool = False, block_v: int = DEFAULT_BLOCK_V,
            num_warps: int = DEFAULT_NUM_WARPS, precision: str = DEFAULT_PRECISION):
    """Chunk-parallel forward; same contract as `kernels.palimpsa.chunk.xla_forward`."""
    num_chunks, batch, heads, chunk_size, dk, dv, dk_pad, block_v, v_tiles = _sizes(chunks, block_v)
    algorithm = dot_algorithm(precision, interpret)
    (q, k, v, beta), poisoned, decay, from_start = _prepared(chunks, reset)
    entering, final_state = _entering_states(k, v, beta, decay, from_start, poisoned, state)
    tokens, values, decays, gates, priors, states, _, _ = _specs(chunk_size, dk_pad, block_v)
    out = jax.ShapeDtypeStruct(v.shape, jnp.float32)
    num_outputs = 2 if return_variance else 1
    outputs = _call(
        _with_variance(_forward_kernel, 10, return_variance), "palimpsa_parallel_forward",
        (num_chunks, batch, heads, v_tiles),
        [tokens, tokens, values, values, decays, gates, priors, states, states],
        [values] * num_outputs, [out] * num_outputs, num_warps, interpret,
        scale=scale, dk=dk, dv=dv, algorithm=algorithm, reciprocal=reciprocal(interpret),
    )(q, k, v, beta, decay, from_start, prior, *entering)
    o = chunking.poison(outputs[0], poisoned)
    variance = chunking.poison(outputs[1], poisoned) if return_variance else None
    return (o, variance), final_state, entering


def backward(chunks, prior, boundary_states, reset, d_out, d_final_state, *, scale: float,
             return_variance: bool, interpret: bool = False, block_v: int = DEFAULT_BLOCK_V,
             num_warps: int = DEFAULT_BACKWARD_NUM_WARPS, precision: str = DEFAULT_PRECISION):
    """Chunk-parallel backward; same contract as `kernels.palimpsa.chunk.xla_backward`."""
    num_chunks, batch, heads, chunk_size, dk, dv, dk_pad, block_v, v_tiles = _sizes(chunks, block_v)
    algorithm = dot_algorithm(precision, interpret)
    (q, k, v, beta), _, decay, from_start = _prepared(chunks, reset)
    tokens, values, decays, gates, priors, states, partial_rows, partial_gates = _specs(
        chunk_size, dk_pad, block_v)
    d_o, d_var = d_out
    cotangents = [d_o] + ([d_var] if return_variance else [])
    grid = (num_chunks, batch, heads, v_tiles)
    inputs = (q, k, v, beta, decay, from_start, prior, *boundary_states, *cotangents)
    in_specs = [tokens, tokens, values, values, decays, gates, priors, states, states, values]
    in_specs += [values] * (len(cotangents) - 1)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    state_shape = f32(num_chunks, batch, heads, dv, dk)
    kwargs = dict(scale=scale, dk=dk, dv=dv, algorithm=algorithm,
                  reciprocal=reciprocal(interpret))

    EM, EI, d_prior = _call(
        _with_variance(_sums_kernel, 10, return_variance), "palimpsa_parallel_cotangent_sums",
        grid, in_specs, [states] * 3, [state_shape] * 3, num_warps, interpret, **kwargs)(*inputs)
    # E_c, the cotangent reaching chunk c's end from later chunks; the last one's, d_final_state.
    carry = from_start[..., -1]
    (E_M, dM0), (E_I, dIbar0) = (
        _chunk_sums(carry, local, d_final, reverse=True)
        for local, d_final in zip((EM, EI), d_final_state))
    dq, dk_, dv_, dbeta, d_log_alpha = _call(
        _with_variance(_gradients_kernel, 10, return_variance), "palimpsa_parallel_gradients",
        grid, in_specs + [states, states],
        [partial_rows, partial_rows, values, values, partial_gates],
        [f32(v_tiles, *q.shape)] * 2 + [f32(*v.shape)] * 2 + [f32(v_tiles, *from_start.shape)],
        num_warps, interpret, **kwargs)(*inputs, E_M, E_I)
    d_log_alpha = jnp.where(reset, 0.0, jnp.sum(d_log_alpha, 0))
    d_chunks = tuple(g.astype(x.dtype) for g, x in zip(
        (jnp.sum(dq, 0), jnp.sum(dk_, 0), dv_, dbeta, d_log_alpha), chunks))
    return d_chunks, jnp.sum(d_prior, axis=(0, 1)), (dM0, dIbar0)
