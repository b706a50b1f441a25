"""Pallas GPU (Triton) forward and backward of the metaplastic recurrence.

Forward, grid (time split, B, H, ceil(Dv / block_v)): each program keeps a (block_v, Dk') tile of
the state (M, Ibar) in registers (Dk' = Dk padded to a power of two, masked), walks the chunks in
a `fori_loop` and the C tokens of a chunk unrolled, with every load of a chunk issued before its
recurrence. It writes the outputs (gathered per chunk), the optional variance and the state
entering every chunk: the residuals of the shared chunked custom VJP (`kernels.palimpsa.chunk`).
Backward, grid (time split, B, H, ceil(Dv / block_v)): chunks in reverse, each chunk's C + 1
states recomputed in registers, then the reverse recurrence of (dL/dM, dL/dIbar). Time splits
run in parallel in both passes: the forward's splits start from the state entering them (a
batched matmul per split and a parallel prefix scan over splits); the backward's from the
cotangent entering them, the reverse scan over splits of what each split's own read-outs give
the state before it (`_cotangent_sums_kernel`, a forward walk of the split, in parallel).

Every 1 / (Ibar + prior) is one MUFU instruction on a GPU (`pallas_gpu_parallel.reciprocal`):
Triton's division cost about eight, and the forward's registers went from 187 to 168, enough for
six programs per SM and the LM shape's 768 programs in one wave (H200, Nsight Compute: forward
1.61 -> 0.81 ms, backward 8.93 -> 7.48 ms; benchmarks/RESULTS.md, twelfth session).

Inputs use the chunk layout (N, B, H, C, ...) of `kernels.chunking`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from palimpsa_jax.kernels import chunking, validation
from palimpsa_jax.kernels.palimpsa import chunk, pallas_gpu_parallel
from palimpsa_jax.kernels.palimpsa.naive import direct_cotangents

DEFAULT_BLOCK_V = 8
DEFAULT_NUM_WARPS = 2
DEFAULT_BACKWARD_NUM_WARPS = 4
DEFAULT_CHUNK_SIZE = 16
DESIGNS = ("recurrent", "parallel")    # this module's passes; `pallas_gpu_parallel`'s
DEFAULT_DESIGN = "recurrent"
# Enough programs to fill an H200 (132 SMs) several times over; fewer (b, h, v-tile) programs
# than this split the time axis (see `_split_entering_states`).
TARGET_PROGRAMS = 1024


def _tile(q_ref, v_ref, prior_ref, tile_axis: int, dk: int, dv: int):
    """Masks of this program's (block_v, Dk') state tile and the tile of its prior.

    tile_axis: the grid axis of the v-tile. Returns k_mask (Dk',), v_mask (block_v,),
    tile_mask (block_v, Dk'), prior (block_v, Dk'; 1 outside the tile) and the token index (C,).
    """
    _, chunk_size, dk_pad = q_ref.shape
    block_v = v_ref.shape[-1]
    k_mask = jnp.arange(dk_pad) < dk
    v_mask = pl.program_id(tile_axis) * block_v + jnp.arange(block_v) < dv
    tile_mask = v_mask[:, None] & k_mask[None, :]
    prior = plgpu.load(prior_ref, mask=tile_mask, other=1.0)
    return k_mask, v_mask, tile_mask, prior, jnp.arange(chunk_size)


def _token_indices(chunk_size: int) -> list:
    """The token indices 0..C-1 of a chunk as arrays of JAX's default integer type: Pallas
    indexes refs with that type (int64 under jax_enable_x64), and one index of another type
    breaks the lowering."""
    return [jnp.asarray(i, dtype=int) for i in range(chunk_size)]


def _load_row(ref, n, i, mask):
    """Row i of chunk n of a (N, C, width) block, float32, zero where masked."""
    return plgpu.load(ref.at[n, i], mask=mask, other=0.0).astype(jnp.float32)


def _kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, prior_ref, M0_ref, Ibar0_ref,
            o_ref, var_ref, M_bound_ref, Ibar_bound_ref, M_ref, Ibar_ref,
            *, scale: float, dk: int, dv: int, reciprocal):
    """One (split, b, h, v-tile) program. decay_ref holds alpha_t with resets already zeroed."""
    num_chunks, chunk_size = q_ref.shape[:2]
    block_v = v_ref.shape[-1]
    k_mask, v_mask, tile_mask, prior, token = _tile(q_ref, v_ref, prior_ref, 3, dk, dv)
    M = plgpu.load(M0_ref, mask=tile_mask, other=0.0)
    Ibar = plgpu.load(Ibar0_ref, mask=tile_mask, other=0.0)

    def chunk(n, state):
        M, Ibar = state
        plgpu.store(M_bound_ref.at[n], M, mask=tile_mask)
        plgpu.store(Ibar_bound_ref.at[n], Ibar, mask=tile_mask)
        # Unrolled; every load of the chunk is issued before the recurrence needs it.
        steps = _token_indices(chunk_size)
        tokens = [(decay_ref[n, i], _load_row(q_ref, n, i, k_mask),
                   _load_row(k_ref, n, i, k_mask), _load_row(v_ref, n, i, v_mask),
                   _load_row(beta_ref, n, i, v_mask))
                  for i in steps]
        # The chunk's outputs are gathered as (block_v, C) columns and stored once.
        o = jnp.zeros((block_v, chunk_size), jnp.float32)
        var = o
        for i, (alpha, q, k, v, beta) in zip(steps, tokens):
            M = alpha * M + v[:, None] * k[None, :]
            Ibar = alpha * Ibar + beta[:, None] * (k * k)[None, :]
            plasticity = reciprocal(Ibar + prior)
            o_t = jnp.sum(M * plasticity * q[None, :], axis=1, keepdims=True)
            o = jnp.where(token[None, :] == i, scale * o_t, o)
            if var_ref is not None:
                var_t = jnp.sum(plasticity * (q * q)[None, :], axis=1, keepdims=True)
                var = jnp.where(token[None, :] == i, scale * scale * var_t, var)
        plgpu.store(o_ref.at[n], o, mask=v_mask[:, None])
        if var_ref is not None:
            plgpu.store(var_ref.at[n], var, mask=v_mask[:, None])
        return M, Ibar

    M, Ibar = jax.lax.fori_loop(0, num_chunks, chunk, (M, Ibar))
    plgpu.store(M_ref, M, mask=tile_mask)
    plgpu.store(Ibar_ref, Ibar, mask=tile_mask)


def _with_variance(kernel, return_variance: bool):
    """The kernel, or, without the variance, the kernel given None for its variance ref: the
    tenth, after the refs of q, k, v, beta, the gates, the prior, a state pair and d_o (or o)."""
    if return_variance:
        return kernel
    return lambda *refs, **kwargs: kernel(*refs[:9], None, *refs[9:], **kwargs)


def _sizes(chunks, block_v: int):
    """(N, B, H, C, Dk, Dv, Dk padded to a power of two, the state tile's rows, tiles over Dv)."""
    num_chunks, batch, heads, chunk_size, dk = chunks[0].shape
    dv = chunks[2].shape[-1]
    block_v = min(block_v, pl.next_power_of_2(dv))
    return (num_chunks, batch, heads, chunk_size, dk, dv, pl.next_power_of_2(dk), block_v,
            pl.cdiv(dv, block_v))


def _tokens_of_splits(x, splits: int):
    """(N, B, H, C, ...) -> (S, B, H, (N / S)·C, ...): the tokens of each time split, in order."""
    num_chunks, batch, heads, chunk_size = x.shape[:4]
    x = x.reshape(splits, num_chunks // splits, batch, heads, chunk_size, *x.shape[4:])
    x = jnp.moveaxis(x, 1, 3)
    return x.reshape(splits, batch, heads, -1, *x.shape[5:])


def _split_decays(log_alpha, reset, splits: int):
    """The decays of `splits` equal time splits of chunked gates log_alpha, reset (N, B, H, C).

    Returns carry (S, B, H), the product of a split's forget gates (0 across a reset), and
    to_end (S, B, H, (N / S)·C), w_t = prod_{u > t in split} alpha_u (0 across a reset).
    """
    log_alpha = _tokens_of_splits(log_alpha.astype(jnp.float32), splits)
    reset = _tokens_of_splits(reset, splits)

    def exclusive_tail_sum(x):  # sum over u > t, without cancellation
        tail = jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)
        return jnp.concatenate([tail[..., 1:], jnp.zeros_like(tail[..., :1])], -1)

    to_end = jnp.where(exclusive_tail_sum(reset.astype(jnp.int32)) > 0, 0.0,
                       jnp.exp(exclusive_tail_sum(log_alpha)))
    carry = jnp.where(jnp.any(reset, -1), 0.0, jnp.exp(jnp.sum(log_alpha, -1)))
    return carry, to_end


def _split_entering_states(chunks, state, reset, splits: int):
    """The (M, Ibar) entering each of `splits` equal time splits, each (S, B, H, Dv, Dk).

    A split's own contribution to its end state is sum_t w_t v_t ⊗ k_t (and beta_t ⊗ k_t²) with
    w_t from `_split_decays`: one batched matmul. A parallel prefix scan over the splits
    (`chunking.chunk_states`) then carries the state across them: S_{s+1} = carry_s S_s + end_s.
    """
    _, k, v, beta, log_alpha = chunks
    carry, to_end = _split_decays(log_alpha, reset, splits)
    f32 = lambda x: _tokens_of_splits(x.astype(jnp.float32), splits)
    k, v, beta = f32(k), f32(v), f32(beta)
    precision = jax.lax.Precision.HIGHEST
    M_end = jnp.einsum("sbht,sbhtv,sbhtk->sbhvk", to_end, v, k, precision=precision)
    Ibar_end = jnp.einsum("sbht,sbhtv,sbhtk->sbhvk", to_end, beta, k * k, precision=precision)
    return tuple(chunking.chunk_states(carry, end, start)[0]
                 for end, start in zip((M_end, Ibar_end), state))


def _checked_splits(time_splits: int | None, num_chunks: int, programs: int,
                    name: str = "time_splits") -> int:
    """time_splits if it divides num_chunks (a ValueError naming the option `name` if not); for
    None, the largest power-of-two S dividing num_chunks with S·programs <= TARGET_PROGRAMS."""
    if time_splits is not None:
        if not (isinstance(time_splits, int) and time_splits > 0 and num_chunks % time_splits == 0):
            raise ValueError(f"{name} must divide the number of chunks {num_chunks}, got "
                             f"{time_splits!r}")
        return time_splits
    splits = 1
    while num_chunks % (2 * splits) == 0 and 2 * splits * programs <= TARGET_PROGRAMS:
        splits *= 2
    return splits


def _split_specs(per_split: int, chunk_size: int, dk_pad: int, block_v: int):
    """BlockSpecs over a grid (split, b, h, v-tile): the split's tokens (width Dk'), values and
    gates, one (block_v, Dk') state tile per (split or chunk, b, h, v-tile), the split's chunk
    boundary states and its (block_v, C) output columns."""
    tokens = pl.BlockSpec((per_split, None, None, chunk_size, dk_pad),
                          lambda s, b, h, j: (s, b, h, 0, 0))
    values = pl.BlockSpec((per_split, None, None, chunk_size, block_v),
                          lambda s, b, h, j: (s, b, h, 0, j))
    gates = pl.BlockSpec((per_split, None, None, chunk_size), lambda s, b, h, j: (s, b, h, 0))
    state = pl.BlockSpec((None, None, None, block_v, dk_pad), lambda s, b, h, j: (s, b, h, j, 0))
    bounds = pl.BlockSpec((per_split, None, None, block_v, dk_pad),
                          lambda s, b, h, j: (s, b, h, j, 0))
    columns = pl.BlockSpec((per_split, None, None, block_v, chunk_size),
                           lambda s, b, h, j: (s, b, h, j, 0))
    return tokens, values, gates, state, bounds, columns


def forward(chunks, prior, state, reset, *, scale: float, return_variance: bool,
            interpret: bool = False, block_v: int = DEFAULT_BLOCK_V,
            num_warps: int = DEFAULT_NUM_WARPS, time_splits: int | None = None):
    """Chunked forward; same contract as `kernels.palimpsa.chunk.xla_forward`.

    Args:
      chunks: (q, k, v, beta, log_alpha) in chunk layout, q, k: (N, B, H, C, Dk); v, beta:
        (N, B, H, C, Dv); log_alpha: (N, B, H, C). prior: (H, Dv, Dk) float32.
      state: (M0, Ibar0), each (B, H, Dv, Dk) float32. reset: (N, B, H, C) bool.
      time_splits: S parallel splits of the chunks (a divisor of N); None picks one so that
        about TARGET_PROGRAMS programs run.
    Returns:
      (o, variance or None) in chunk layout (float32), the final (M, Ibar), and the states
      entering each chunk, each (N, B, H, Dv, Dk).
    """
    q, k, v, beta, log_alpha = chunks
    num_chunks, batch, heads, chunk_size, dk, dv, dk_pad, block_v, v_tiles = _sizes(chunks, block_v)
    splits = _checked_splits(time_splits, num_chunks, batch * heads * v_tiles)
    entering = (jax.tree.map(lambda x: x[None], state) if splits == 1 else
                _split_entering_states(chunks, state, reset, splits))
    decay = chunking.gates(log_alpha, reset)
    per_split = num_chunks // splits

    tokens, values, gates, state, bounds, columns = _split_specs(per_split, chunk_size, dk_pad,
                                                                 block_v)
    state_shape = jax.ShapeDtypeStruct((splits, batch, heads, dv, dk), jnp.float32)
    bound_shape = jax.ShapeDtypeStruct((num_chunks, batch, heads, dv, dk), jnp.float32)
    out_shape = jax.ShapeDtypeStruct((num_chunks, batch, heads, dv, chunk_size), jnp.float32)
    num_outputs = 2 if return_variance else 1

    outputs = pl.pallas_call(
        functools.partial(_with_variance(_kernel, return_variance), scale=scale, dk=dk, dv=dv,
                          reciprocal=pallas_gpu_parallel.reciprocal(interpret)),
        grid=(splits, batch, heads, v_tiles),
        in_specs=[tokens, tokens, values, values, gates,
                  pl.BlockSpec((None, block_v, dk_pad), lambda s, b, h, j: (h, j, 0)),
                  state, state],
        out_specs=[columns] * num_outputs + [bounds] * 2 + [state] * 2,
        out_shape=[out_shape] * num_outputs + [bound_shape] * 2 + [state_shape] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="palimpsa_forward",
    )(q, k, v, beta, decay, prior, *entering)
    out = tuple(jnp.swapaxes(x, -1, -2) for x in outputs[:num_outputs])  # (N, B, H, C, Dv)
    out = (out[0], out[1] if return_variance else None)
    M_bound, Ibar_bound, M_last, Ibar_last = outputs[num_outputs:]
    return out, (M_last[-1], Ibar_last[-1]), (M_bound, Ibar_bound)


def _cotangent_sums_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, prior_ref, M_in_ref,
                           Ibar_in_ref, d_o_ref, d_var_ref, EM_ref, EI_ref, *, scale: float,
                           dk: int, dv: int, reciprocal):
    """One (split, b, h, v-tile) program: what the split's own read-outs give the cotangent of the
    state entering it, E = sum_t (alpha_a ... alpha_t) (direct dL/dM_t, direct dL/dIbar_t) over
    its tokens a..t, walking them forward from the split's entering state."""
    num_chunks, chunk_size = q_ref.shape[:2]
    k_mask, v_mask, tile_mask, prior, _ = _tile(q_ref, v_ref, prior_ref, 3, dk, dv)

    def chunk(n, carry):
        M, Ibar, EM, EI, weight = carry
        tokens = [(decay_ref[n, i], _load_row(q_ref, n, i, k_mask),
                   _load_row(k_ref, n, i, k_mask), _load_row(v_ref, n, i, v_mask),
                   _load_row(beta_ref, n, i, v_mask), _load_row(d_o_ref, n, i, v_mask),
                   None if d_var_ref is None else _load_row(d_var_ref, n, i, v_mask))
                  for i in _token_indices(chunk_size)]
        for alpha, q, k, v, beta, d_o, d_var in tokens:
            M = alpha * M + v[:, None] * k[None, :]
            Ibar = alpha * Ibar + beta[:, None] * (k * k)[None, :]
            d_M, d_Ibar, _, _ = direct_cotangents(
                M, Ibar, prior, q[None, :], d_o[:, None],
                None if d_var is None else d_var[:, None], scale, reciprocal)
            weight = weight * alpha
            EM, EI = EM + weight * d_M, EI + weight * d_Ibar
        return M, Ibar, EM, EI, weight

    M = plgpu.load(M_in_ref, mask=tile_mask, other=0.0)
    Ibar = plgpu.load(Ibar_in_ref, mask=tile_mask, other=0.0)
    zeros = jnp.zeros_like(M)
    _, _, EM, EI, _ = jax.lax.fori_loop(0, num_chunks, chunk,
                                        (M, Ibar, zeros, zeros, jnp.float32(1.0)))
    plgpu.store(EM_ref, EM, mask=tile_mask)
    plgpu.store(EI_ref, EI, mask=tile_mask)


def _backward_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, prior_ref, M_bound_ref,
                     Ibar_bound_ref, d_o_ref, d_var_ref, dM_ref, dIbar_ref,
                     dq_ref, dk_ref, dv_ref, dbeta_ref, d_decay_ref, d_prior_ref, dM0_ref,
                     dIbar0_ref, *, scale: float, dk: int, dv: int, reciprocal):
    """One (b, h, v-tile) program of the backward, walking the chunks in reverse.

    Each chunk's states are recomputed in registers from its entering state; then, token by
    token in reverse, the state cotangents (GM, GI) = (dL/dM_t, dL/dIbar_t) take the read-out's
    direct terms, give the inputs' gradients, and are decayed by alpha_t. dq and dk are partial
    sums over this v-tile; dv, dbeta and the per-row terms of dL/dalpha are gathered as
    (block_v, C) columns and stored once per chunk; dL/dprior is accumulated element-wise and
    stored once.
    """
    num_chunks, chunk_size = q_ref.shape[:2]
    block_v = v_ref.shape[-1]
    k_mask, v_mask, tile_mask, prior, token = _tile(q_ref, v_ref, prior_ref, 3, dk, dv)
    column_mask = v_mask[:, None]
    row_sum = lambda x: jnp.sum(x, axis=1, keepdims=True)

    def chunk(r, carry):
        GM, GI, d_prior = carry
        n = num_chunks - 1 - r
        steps = _token_indices(chunk_size)
        tokens = [(decay_ref[n, i], _load_row(q_ref, n, i, k_mask),
                   _load_row(k_ref, n, i, k_mask), _load_row(v_ref, n, i, v_mask),
                   _load_row(beta_ref, n, i, v_mask), _load_row(d_o_ref, n, i, v_mask),
                   None if d_var_ref is None else _load_row(d_var_ref, n, i, v_mask))
                  for i in steps]
        M = plgpu.load(M_bound_ref.at[n], mask=tile_mask, other=0.0)
        Ibar = plgpu.load(Ibar_bound_ref.at[n], mask=tile_mask, other=0.0)
        states = [(M, Ibar)]
        for alpha, _, k, v, beta, _, _ in tokens:
            M = alpha * M + v[:, None] * k[None, :]
            Ibar = alpha * Ibar + beta[:, None] * (k * k)[None, :]
            states.append((M, Ibar))
        d_v = d_beta = d_alpha = jnp.zeros((block_v, chunk_size), jnp.float32)
        for t in reversed(range(chunk_size)):
            i = steps[t]
            alpha, q, k, v, beta, d_o, d_var = tokens[t]
            (M, Ibar), (M_prev, Ibar_prev) = states[t + 1], states[t]
            d_M, d_precision, plasticity, mu = direct_cotangents(
                M, Ibar, prior, q[None, :], d_o[:, None],
                None if d_var is None else d_var[:, None], scale, reciprocal)
            GM = GM + d_M
            dq = scale * jnp.sum(d_o[:, None] * mu, axis=0)
            if d_var is not None:
                dq += 2 * scale * scale * q * jnp.sum(d_var[:, None] * plasticity, axis=0)
            d_prior += d_precision
            GI = GI + d_precision
            plgpu.store(dq_ref.at[n, i], dq, mask=k_mask)
            plgpu.store(dk_ref.at[n, i],
                        jnp.sum(GM * v[:, None] + GI * (2 * beta[:, None] * k[None, :]), axis=0),
                        mask=k_mask)
            is_t = token[None, :] == i
            d_v = jnp.where(is_t, row_sum(GM * k[None, :]), d_v)
            d_beta = jnp.where(is_t, row_sum(GI * (k * k)[None, :]), d_beta)
            d_alpha = jnp.where(is_t, row_sum(GM * M_prev + GI * Ibar_prev), d_alpha)
            GM, GI = alpha * GM, alpha * GI
        plgpu.store(dv_ref.at[n], d_v, mask=column_mask)
        plgpu.store(dbeta_ref.at[n], d_beta, mask=column_mask)
        plgpu.store(d_decay_ref.at[n], d_alpha, mask=column_mask)
        return GM, GI, d_prior

    GM = plgpu.load(dM_ref, mask=tile_mask, other=0.0)
    GI = plgpu.load(dIbar_ref, mask=tile_mask, other=0.0)
    GM, GI, d_prior = jax.lax.fori_loop(0, num_chunks, chunk,
                                        (GM, GI, jnp.zeros_like(GM)))
    plgpu.store(dM0_ref, GM, mask=tile_mask)
    plgpu.store(dIbar0_ref, GI, mask=tile_mask)
    plgpu.store(d_prior_ref, d_prior, mask=tile_mask)


def _entering_cotangents(chunks, prior, boundary_states, reset, decay, d_out, d_final_state,
                         splits: int, *, scale: float, return_variance: bool, interpret: bool,
                         block_v: int, num_warps: int):
    """The cotangent (dL/dM, dL/dIbar) of the state leaving each of `splits` time splits, each
    (S, B, H, Dv, Dk): C_{S-1} = d_final_state, C_s = E_{s+1} + A_{s+1} C_{s+1}, with E the
    splits' own sums (`_cotangent_sums_kernel`, parallel over splits) and A (S, B, H) the
    product of a split's forget gates (`_split_decays`)."""
    if splits == 1:
        return jax.tree.map(lambda x: x[None], d_final_state)
    q, k, v, beta, log_alpha = chunks
    carry, _ = _split_decays(log_alpha, reset, splits)
    num_chunks, batch, heads, chunk_size, dk, dv, dk_pad, block_v, v_tiles = _sizes(chunks, block_v)
    per_split = num_chunks // splits
    tokens, values, gates, state, _, _ = _split_specs(per_split, chunk_size, dk_pad, block_v)
    entering = pl.BlockSpec((None, None, None, block_v, dk_pad),
                            lambda s, b, h, j: (s * per_split, b, h, j, 0))
    d_o, d_var = d_out
    variance = [d_var] if return_variance else []
    sums = pl.pallas_call(
        functools.partial(_with_variance(_cotangent_sums_kernel, return_variance), scale=scale,
                          dk=dk, dv=dv, reciprocal=pallas_gpu_parallel.reciprocal(interpret)),
        grid=(splits, batch, heads, v_tiles),
        in_specs=[tokens, tokens, values, values, gates,
                  pl.BlockSpec((None, block_v, dk_pad), lambda s, b, h, j: (h, j, 0)),
                  entering, entering, values] + [values] * len(variance),
        out_specs=[state, state],
        out_shape=[jax.ShapeDtypeStruct((splits, batch, heads, dv, dk), jnp.float32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="palimpsa_cotangent_sums",
    )(q, k, v, beta, decay, prior, *boundary_states, d_o, *variance)
    # The reverse scan over splits, as a forward scan over the flipped splits.
    reverse = lambda x: jnp.flip(x, 0)
    return tuple(reverse(chunking.chunk_states(reverse(carry), reverse(E), dF)[0])
                 for E, dF in zip(sums, d_final_state))


def backward(chunks, prior, boundary_states, reset, d_out, d_final_state, *, scale: float,
             return_variance: bool, interpret: bool = False, block_v: int = DEFAULT_BLOCK_V,
             num_warps: int = DEFAULT_BACKWARD_NUM_WARPS, time_splits: int | None = None):
    """Pallas backward; same contract as `kernels.palimpsa.chunk.xla_backward`.

    time_splits: S parallel splits of the chunks (a divisor of N), each walked in reverse from
    the cotangent entering it (`_entering_cotangents`); None picks one so that about
    TARGET_PROGRAMS programs run.
    """
    q, k, v, beta, log_alpha = chunks
    num_chunks, batch, heads, chunk_size, dk, dv, dk_pad, block_v, v_tiles = _sizes(chunks, block_v)
    splits = _checked_splits(time_splits, num_chunks, batch * heads * v_tiles,
                             "backward_time_splits")
    per_split = num_chunks // splits
    decay = chunking.gates(log_alpha, reset)
    d_o, d_var = d_out
    d_entering = _entering_cotangents(
        chunks, prior, boundary_states, reset, decay, d_out, d_final_state, splits, scale=scale,
        return_variance=return_variance, interpret=interpret, block_v=block_v,
        num_warps=num_warps)

    tokens, values, gates, state, bounds, columns = _split_specs(per_split, chunk_size, dk_pad,
                                                                 block_v)
    partial = pl.BlockSpec((None, per_split, None, None, chunk_size, dk_pad),
                           lambda s, b, h, j: (j, s, b, h, 0, 0))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    variance = [d_var] if return_variance else []
    dq, dk_, dv_, dbeta, d_decay, d_prior, dM0, dIbar0 = pl.pallas_call(
        functools.partial(_with_variance(_backward_kernel, return_variance), scale=scale,
                          dk=dk, dv=dv, reciprocal=pallas_gpu_parallel.reciprocal(interpret)),
        grid=(splits, batch, heads, v_tiles),
        in_specs=[tokens, tokens, values, values, gates,
                  pl.BlockSpec((None, block_v, dk_pad), lambda s, b, h, j: (h, j, 0)),
                  bounds, bounds, values] + [values] * len(variance) + [state, state],
        out_specs=[partial] * 2 + [columns] * 3 + [state] * 3,
        out_shape=[f32(v_tiles, num_chunks, batch, heads, chunk_size, dk)] * 2
                  + [f32(num_chunks, batch, heads, dv, chunk_size)] * 3
                  + [f32(splits, batch, heads, dv, dk)] * 3,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="palimpsa_backward",
    )(q, k, v, beta, decay, prior, *boundary_states, d_o, *variance, *d_entering)
    d_log_alpha = jnp.sum(d_decay, -2) * decay
    d_chunks = tuple(g.astype(x.dtype) for g, x in zip(
        (jnp.sum(dq, 0), jnp.sum(dk_, 0), jnp.swapaxes(dv_, -1, -2), jnp.swapaxes(dbeta, -1, -2),
         d_log_alpha), chunks))
    return d_chunks, jnp.sum(d_prior, axis=(0, 1)), (dM0[0], dIbar0[0])


def palimpsa_pallas_gpu(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, *, scale: float,
                        return_variance: bool, chunk_size: int | None = None,
                        interpret: bool = False, design: str = DEFAULT_DESIGN,
                        block_v: int | None = None, num_warps: int | None = None,
                        time_splits: int | None = None, backward_block_v: int | None = None,
                        backward_num_warps: int | None = None,
                        backward_time_splits: int | None = None, precision: str | None = None):
    """Pallas GPU backend; same arguments and returns as `palimpsa_reference`.

    design: "parallel" (every (chunk, b, h, row tile) a program, the per-token states of a row
    as matrix multiplies: `pallas_gpu_parallel`) or "recurrent" (every (time split, b, h, row
    tile) a program walking its tokens: this module). Forward and backward are Pallas kernels
    under the shared chunked custom VJP; block_v and num_warps tune the forward,
    backward_block_v and backward_num_warps the backward (None: the design's defaults);
    time_splits and backward_time_splits (recurrent only; None picks them from the program
    count); precision (parallel only: `pallas_gpu_parallel.dot_algorithm`, default "float32").
    chunk_size: a power of two (None: the design's default; at least 16 for the
    parallel design's matrix multiplies on a GPU). `interpret=True` runs the same kernel bodies
    in Pallas interpret mode on any platform.
    """
    validation.check_platform("pallas_gpu", "gpu", interpret)
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    parallel = design == "parallel"
    if chunk_size is None:
        chunk_size = pallas_gpu_parallel.DEFAULT_CHUNK_SIZE if parallel else DEFAULT_CHUNK_SIZE
    if chunk_size & (chunk_size - 1) or chunk_size < 1 or (parallel and not interpret
                                                            and chunk_size < 16):
        raise ValueError(f"chunk_size must be a power of two{' >= 16' * parallel} for "
                         f"pallas_gpu design {design!r}, got {chunk_size}")
    if parallel and (time_splits, backward_time_splits) != (None, None):
        raise ValueError("time_splits and backward_time_splits are options of the 'recurrent' "
                         "design of pallas_gpu")
    if not parallel and precision is not None:
        raise ValueError("precision is an option of the 'parallel' design of pallas_gpu")
    # Only the options given; the passes' own keyword defaults are the design's defaults.
    given = lambda **options: {name: x for name, x in options.items() if x is not None}
    passes = (pallas_gpu_parallel.forward, pallas_gpu_parallel.backward) if parallel else (
        forward, backward)
    return chunk.chunked(
        q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, scale=scale,
        return_variance=return_variance, chunk_size=chunk_size,
        forward=functools.partial(passes[0], **given(
            interpret=interpret, block_v=block_v, num_warps=num_warps, time_splits=time_splits,
            precision=precision)),
        backward=functools.partial(passes[1], **given(
            interpret=interpret, block_v=backward_block_v, num_warps=backward_num_warps,
            time_splits=backward_time_splits, precision=precision)))
