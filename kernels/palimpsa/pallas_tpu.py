"""Pallas TPU (Mosaic) forward and backward of the metaplastic recurrence.

Grid (B, H, N): one program per (batch, head, chunk); B and H are "parallel", the chunk axis is
"arbitrary" (sequential), so the state of a head lives in VMEM scratch across it: the whole
(Dv', Dk') tile of (M, Ibar), with Dk' = Dk rounded up to 128 lanes and Dv' = Dv rounded up to 8
sublanes (zero padding, added and removed by the wrappers: zero q/k columns and v/beta rows
contribute nothing, and prior > 0 keeps 1 / (Ibar + prior) finite in the padding). Inside a
program a `fori_loop` walks the C tokens of the chunk.

Layout per program: q, k are (C, Dk') blocks, a token is a row; v, beta, the outputs
(o, variance) and their cotangents are transposed to (Dv', C) blocks so that a token is a column
that broadcasts against the (Dv', Dk') state; the gates alpha_t (resets zeroed) are a (1, C) row.
Rows and columns of a token are picked and set with iota masks (select + reduction) on values
loaded once per chunk, so the kernel has no dynamic offsets in the tiled (last two) dimensions;
the only dynamic indexing is on the leading dimension of VMEM scratch. The prior is a
(Dv', Dk') block per head (1 in the padding).

The forward writes o, the optional variance, the state entering every chunk (the residuals of the
shared custom VJP of `kernels.palimpsa.chunk`) and the final state. The backward walks the chunks
in reverse; for each it recomputes the per-token states from the saved entering state in
sub-chunks (checkpoints every S tokens, then the S + 1 states of one sub-chunk at a time in VMEM
scratch: under 5 MiB at Dk = Dv = 128, C = 128, S = 32, about 7 MiB with the double-buffered
blocks) and runs the reverse recurrence of the state cotangents (dL/dM_t, dL/dIbar_t), which
stay in VMEM scratch across chunks.

Inputs and outputs of `forward` / `backward` use the chunk layout (N, B, H, C, ...) of
`kernels.chunking`, with the contracts of `chunk.xla_forward` / `chunk.xla_backward`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from palimpsa_jax.kernels import chunking, validation
from palimpsa_jax.kernels.palimpsa import chunk

DEFAULT_CHUNK_SIZE = 128
MAX_SUB_CHUNK = 32
LANES = 128
SUBLANES = 8
_F32 = jnp.float32
_SQ = pl.squeezed


def _interpret(interpret):
    """False, or the TPU interpret-mode parameters (True -> defaults)."""
    if not interpret or isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams()


def _sub_chunk(chunk_size: int, sub_chunk: int | None) -> int:
    """The recomputation sub-chunk S of the backward: a divisor of C (largest <= MAX_SUB_CHUNK)."""
    if sub_chunk is None:
        return max(d for d in range(1, min(chunk_size, MAX_SUB_CHUNK) + 1) if chunk_size % d == 0)
    if not (isinstance(sub_chunk, int) and sub_chunk > 0 and chunk_size % sub_chunk == 0):
        raise ValueError(f"sub_chunk must be a positive divisor of chunk_size {chunk_size}, "
                         f"got {sub_chunk!r}")
    return sub_chunk


def _pick(block, t, axis: int):
    """Slice t of a 2-D value along `axis` (keeping it as a size-1 axis): a masked reduction
    (exact, one non-zero). axis 1 picks a column (R, 1), axis 0 a row (1, D)."""
    index = jax.lax.broadcasted_iota(jnp.int32, block.shape, axis)
    return jnp.sum(jnp.where(index == t, block, 0.0), axis=axis, keepdims=True)


def _put(block, t, value, axis: int):
    """block with slice t along `axis` replaced by `value` (size 1 along `axis`)."""
    index = jax.lax.broadcasted_iota(jnp.int32, block.shape, axis)
    return jnp.where(index == t, value, block)


_column = functools.partial(_pick, axis=1)
_row = functools.partial(_pick, axis=0)
_set_column = functools.partial(_put, axis=1)
_set_row = functools.partial(_put, axis=0)


def _advance(t, state, k, vT, betaT, alphas):
    """One token of the recurrence on the (Dv', Dk') state values; k is the (C, Dk') block."""
    M, Ibar = state
    k = _row(k, t)
    alpha = _column(alphas, t)
    return (alpha * M + _column(vT, t) * k, alpha * Ibar + _column(betaT, t) * (k * k))


def _forward_kernel(prior_ref, q_ref, k_ref, vT_ref, betaT_ref, alpha_ref, M0_ref, Ibar0_ref,
                    oT_ref, varT_ref, M_bound_ref, Ibar_bound_ref, M_last_ref, Ibar_last_ref,
                    M_scratch, Ibar_scratch, *, scale: float):
    """One (b, h, chunk) program; the head's state is carried in VMEM scratch across chunks."""
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        M_scratch[...] = M0_ref[...]
        Ibar_scratch[...] = Ibar0_ref[...]

    state = (M_scratch[...], Ibar_scratch[...])
    M_bound_ref[...] = state[0]
    Ibar_bound_ref[...] = state[1]
    prior = prior_ref[...]
    q, k, vT, betaT, alphas = (ref[...] for ref in (q_ref, k_ref, vT_ref, betaT_ref, alpha_ref))

    def token(t, carry):
        state, o, var = carry
        M, Ibar = state = _advance(t, state, k, vT, betaT, alphas)
        q_t = _row(q, t)
        plasticity = 1.0 / (Ibar + prior)
        o = _set_column(o, t, scale * jnp.sum(M * plasticity * q_t, axis=1, keepdims=True))
        if var is not None:
            var = _set_column(var, t, (scale * scale)
                              * jnp.sum(plasticity * (q_t * q_t), axis=1, keepdims=True))
        return state, o, var

    zeros = jnp.zeros(oT_ref.shape, _F32)
    (M, Ibar), o, var = jax.lax.fori_loop(
        0, q_ref.shape[0], token, (state, zeros, None if varT_ref is None else zeros))
    oT_ref[...] = o
    if varT_ref is not None:
        varT_ref[...] = var
    M_scratch[...] = M
    Ibar_scratch[...] = Ibar

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        M_last_ref[...] = M
        Ibar_last_ref[...] = Ibar


def _forward_without_variance(prior_ref, q_ref, k_ref, vT_ref, betaT_ref, alpha_ref, M0_ref,
                              Ibar0_ref, oT_ref, *refs, **kwargs):
    _forward_kernel(prior_ref, q_ref, k_ref, vT_ref, betaT_ref, alpha_ref, M0_ref, Ibar0_ref,
                    oT_ref, None, *refs, **kwargs)


class _Layout:
    """Padded, TPU-friendly views of the chunked inputs and the BlockSpecs of a (B, H, N) grid.

    `reverse` maps grid step r to chunk N - 1 - r (the backward walks the chunks in reverse).
    """

    def __init__(self, chunks, reset, *, reverse: bool = False):
        q, k, v, beta, log_alpha = chunks
        self.num_chunks, self.batch, self.heads, self.chunk_size, self.dk = q.shape
        self.dv = v.shape[-1]
        self.dk_pad = chunking.round_up(self.dk, LANES)
        self.dv_pad = chunking.round_up(self.dv, SUBLANES)
        self.alpha = chunking.gates(log_alpha, reset)  # (N, B, H, C)
        self.inputs = (self.rows(q), self.rows(k), self.columns(v), self.columns(beta),
                       self.alpha[..., None, :])
        self.prior_block = pl.BlockSpec((_SQ, self.dv_pad, self.dk_pad), lambda b, h, r: (h, 0, 0))
        last = self.num_chunks - 1
        chunk_of = (lambda r: last - r) if reverse else (lambda r: r)
        self._chunk_map = lambda b, h, r: (chunk_of(r), b, h, 0, 0)

    def rows(self, x):
        """(N, B, H, C, Dk) -> float32 (N, B, H, C, Dk')."""
        return chunking.pad_axis(x.astype(_F32), -1, self.dk_pad)

    def columns(self, x):
        """(N, B, H, C, Dv) -> float32 (N, B, H, Dv', C)."""
        return jnp.swapaxes(chunking.pad_axis(x.astype(_F32), -1, self.dv_pad), -1, -2)

    def state(self, x, value: float = 0.0):
        """(..., Dv, Dk) -> (..., Dv', Dk'), padded with `value`."""
        x = chunking.pad_axis(x, -1, self.dk_pad, value)
        return chunking.pad_axis(x, -2, self.dv_pad, value)

    def unstate(self, x):
        return x[..., :self.dv, :self.dk]

    def per_chunk(self, *block):
        """Block of one chunk of an (N, B, H, *block) array."""
        return pl.BlockSpec((_SQ, _SQ, _SQ, *block), self._chunk_map)

    @property
    def input_specs(self):
        C, dk, dv = self.chunk_size, self.dk_pad, self.dv_pad
        return [self.prior_block,  # (H, Dv', Dk')
                self.per_chunk(C, dk), self.per_chunk(C, dk), self.per_chunk(dv, C),
                self.per_chunk(dv, C), self.per_chunk(1, C)]

    def per_head(self, *block):
        """Block of one head of a (B, H, *block) array, the same for every chunk."""
        return pl.BlockSpec((_SQ, _SQ, *block), lambda b, h, r: (b, h, 0, 0))

    def shape(self, *shape):
        return jax.ShapeDtypeStruct(shape, _F32)


def _pallas_call(layout, kernel, *, extra_in_specs, out_specs, out_shape, scratch_shapes,
                 interpret, name):
    """The (B, H, N) pallas_call of `layout` with its input specs followed by `extra_in_specs`."""
    return pl.pallas_call(
        kernel,
        grid=(layout.batch, layout.heads, layout.num_chunks),
        in_specs=layout.input_specs + extra_in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name=name,
    )


def forward(chunks, prior, state, reset, *, scale: float, return_variance: bool,
            interpret=False):
    """Chunked forward; same contract as `kernels.palimpsa.chunk.xla_forward`.

    Args:
      chunks: (q, k, v, beta, log_alpha) in chunk layout, q, k: (N, B, H, C, Dk); v, beta:
        (N, B, H, C, Dv); log_alpha: (N, B, H, C). prior: (H, Dv, Dk) float32.
      state: (M0, Ibar0), each (B, H, Dv, Dk) float32. reset: (N, B, H, C) bool.
      interpret: True (or `pltpu.InterpretParams`) runs the kernel in TPU interpret mode.
    Returns:
      (o, variance or None) in chunk layout (float32), the final (M, Ibar), and the states
      entering each chunk, each (N, B, H, Dv, Dk).
    """
    layout = _Layout(chunks, reset)
    N, B, H, C = layout.num_chunks, layout.batch, layout.heads, layout.chunk_size
    dk, dv = layout.dk_pad, layout.dv_pad
    num_outputs = 2 if return_variance else 1
    with jax.enable_x64(False):  # the kernel indexes with int32 whatever the global setting
        outputs = _pallas_call(
            layout,
            functools.partial(_forward_kernel if return_variance else _forward_without_variance,
                              scale=scale),
            extra_in_specs=[layout.per_head(dv, dk)] * 2,
            out_specs=[layout.per_chunk(dv, C)] * num_outputs + [layout.per_chunk(dv, dk)] * 2
                      + [layout.per_head(dv, dk)] * 2,
            out_shape=[layout.shape(N, B, H, dv, C)] * num_outputs
                      + [layout.shape(N, B, H, dv, dk)] * 2 + [layout.shape(B, H, dv, dk)] * 2,
            scratch_shapes=[pltpu.VMEM((dv, dk), _F32)] * 2,
            interpret=interpret,
            name="palimpsa_forward_tpu",
        )(layout.state(prior, 1.0), *layout.inputs, *(layout.state(x) for x in state))
    time_major = lambda x: jnp.swapaxes(x, -1, -2)[..., :layout.dv]  # (N, B, H, C, Dv)
    out = (time_major(outputs[0]), time_major(outputs[1]) if return_variance else None)
    M_bound, Ibar_bound, M_last, Ibar_last = map(layout.unstate, outputs[num_outputs:])
    return out, (M_last, Ibar_last), (M_bound, Ibar_bound)


def _backward_kernel(prior_ref, q_ref, k_ref, vT_ref, betaT_ref, alpha_ref, M_bound_ref,
                     Ibar_bound_ref, d_oT_ref, d_varT_ref, dM_ref, dIbar_ref,
                     dq_ref, dk_ref, dvT_ref, dbetaT_ref, d_alpha_ref, d_prior_ref, dM0_ref,
                     dIbar0_ref, GM_scratch, GI_scratch, d_prior_scratch, M_checkpoints,
                     Ibar_checkpoints, M_states, Ibar_states, *, scale: float, sub_chunk: int):
    """One (b, h, reversed chunk) program of the backward.

    The chunk's states are recomputed from its entering state: first the checkpoints every S
    tokens, then, sub-chunk by sub-chunk from the last, the states of its S tokens (slot 0 holds
    the state entering the sub-chunk). Token by token in reverse, the state cotangents
    (GM, GI) = (dL/dM_t, dL/dIbar_t) take the read-out's direct terms, give the inputs' gradients
    and are decayed by alpha_t; they are carried across chunks in VMEM scratch.
    """
    r = pl.program_id(2)

    @pl.when(r == 0)
    def _():
        GM_scratch[...] = dM_ref[...]
        GI_scratch[...] = dIbar_ref[...]
        d_prior_scratch[...] = jnp.zeros(d_prior_scratch.shape, _F32)

    prior = prior_ref[...]
    q, k, vT, betaT, alphas, d_oT = (
        ref[...] for ref in (q_ref, k_ref, vT_ref, betaT_ref, alpha_ref, d_oT_ref))
    d_varT = None if d_varT_ref is None else d_varT_ref[...]
    advance = functools.partial(_advance, k=k, vT=vT, betaT=betaT, alphas=alphas)
    num_sub = q.shape[0] // sub_chunk

    def checkpoint(j, state):
        M_checkpoints[j], Ibar_checkpoints[j] = state
        return jax.lax.fori_loop(j * sub_chunk, (j + 1) * sub_chunk, advance, state)

    state = jax.lax.fori_loop(0, num_sub - 1, checkpoint, (M_bound_ref[...], Ibar_bound_ref[...]))
    M_checkpoints[num_sub - 1], Ibar_checkpoints[num_sub - 1] = state

    def sub_chunk_body(jr, carry):
        start = (num_sub - 1 - jr) * sub_chunk
        state = (M_checkpoints[num_sub - 1 - jr], Ibar_checkpoints[num_sub - 1 - jr])
        M_states[0], Ibar_states[0] = state

        def recompute(s, state):
            state = advance(start + s, state)
            M_states[s + 1], Ibar_states[s + 1] = state
            return state

        # The sub-chunk's last state is the state after the first token walked in reverse.
        after = jax.lax.fori_loop(0, sub_chunk, recompute, state)

        def token(sr, carry):
            grads, (M, Ibar) = carry  # (M, Ibar) after token t
            GM, GI, d_prior, dq, dk, dv, dbeta, d_alpha = grads
            s = sub_chunk - 1 - sr
            t = start + s
            before = (M_states[s], Ibar_states[s])
            q_t, k_t = _row(q, t), _row(k, t)
            v, beta, d_o = _column(vT, t), _column(betaT, t), _column(d_oT, t)
            plasticity = 1.0 / (Ibar + prior)
            mu = M * plasticity
            GM = GM + scale * d_o * q_t * plasticity
            d_precision = scale * d_o * q_t * mu
            dq_t = scale * jnp.sum(d_o * mu, axis=0, keepdims=True)
            if d_varT is not None:
                d_var = _column(d_varT, t)
                d_precision = d_precision + (scale * scale) * d_var * (q_t * q_t) * plasticity
                dq_t = dq_t + (2 * scale * scale) * q_t * jnp.sum(d_var * plasticity, axis=0,
                                                                  keepdims=True)
            d_precision = -plasticity * d_precision
            d_prior = d_prior + d_precision
            GI = GI + d_precision
            dq = _set_row(dq, t, dq_t)
            dk = _set_row(dk, t, jnp.sum(GM * v, axis=0, keepdims=True)
                          + 2 * k_t * jnp.sum(GI * beta, axis=0, keepdims=True))
            dv = _set_column(dv, t, jnp.sum(GM * k_t, axis=1, keepdims=True))
            dbeta = _set_column(dbeta, t, jnp.sum(GI * (k_t * k_t), axis=1, keepdims=True))
            d_alpha_t = jnp.sum(GM * before[0] + GI * before[1], axis=1, keepdims=True)
            d_alpha = _set_column(d_alpha, t, jnp.sum(d_alpha_t, axis=0, keepdims=True))
            alpha = _column(alphas, t)
            return (alpha * GM, alpha * GI, d_prior, dq, dk, dv, dbeta, d_alpha), before

        return jax.lax.fori_loop(0, sub_chunk, token, (carry, after))[0]

    zeros = lambda ref: jnp.zeros(ref.shape, _F32)
    GM, GI, d_prior, dq, dk, dv, dbeta, d_alpha = jax.lax.fori_loop(
        0, num_sub, sub_chunk_body,
        (GM_scratch[...], GI_scratch[...], d_prior_scratch[...], zeros(dq_ref), zeros(dk_ref),
         zeros(dvT_ref), zeros(dbetaT_ref), zeros(d_alpha_ref)))
    dq_ref[...] = dq
    dk_ref[...] = dk
    dvT_ref[...] = dv
    dbetaT_ref[...] = dbeta
    d_alpha_ref[...] = d_alpha
    GM_scratch[...] = GM
    GI_scratch[...] = GI
    d_prior_scratch[...] = d_prior

    @pl.when(r == pl.num_programs(2) - 1)
    def _():
        dM0_ref[...] = GM
        dIbar0_ref[...] = GI
        d_prior_ref[...] = d_prior


def _backward_without_variance(prior_ref, q_ref, k_ref, vT_ref, betaT_ref, alpha_ref,
                               M_bound_ref, Ibar_bound_ref, d_oT_ref, *refs, **kwargs):
    _backward_kernel(prior_ref, q_ref, k_ref, vT_ref, betaT_ref, alpha_ref, M_bound_ref,
                     Ibar_bound_ref, d_oT_ref, None, *refs, **kwargs)


def backward(chunks, prior, boundary_states, reset, d_out, d_final_state, *, scale: float,
             return_variance: bool, interpret=False, sub_chunk: int | None = None):
    """Pallas TPU backward; same contract as `kernels.palimpsa.chunk.xla_backward`.

    sub_chunk: tokens S whose states are recomputed and held in VMEM at a time (a divisor of
    the chunk size; None picks the largest one <= MAX_SUB_CHUNK).
    """
    layout = _Layout(chunks, reset, reverse=True)
    N, B, H, C = layout.num_chunks, layout.batch, layout.heads, layout.chunk_size
    dk, dv = layout.dk_pad, layout.dv_pad
    S = _sub_chunk(C, sub_chunk)
    d_o, d_var = d_out
    cotangents = [layout.columns(d_o)] + ([layout.columns(d_var)] if return_variance else [])
    with jax.enable_x64(False):  # the kernel indexes with int32 whatever the global setting
        dq, dk_, dv_, dbeta, d_alpha, d_prior, dM0, dIbar0 = _pallas_call(
            layout,
            functools.partial(_backward_kernel if return_variance else _backward_without_variance,
                              scale=scale, sub_chunk=S),
            extra_in_specs=[layout.per_chunk(dv, dk)] * 2 + [layout.per_chunk(dv, C)]
                           * len(cotangents) + [layout.per_head(dv, dk)] * 2,
            out_specs=[layout.per_chunk(C, dk)] * 2 + [layout.per_chunk(dv, C)] * 2
                      + [layout.per_chunk(1, C)] + [layout.per_head(dv, dk)] * 3,
            out_shape=[layout.shape(N, B, H, C, dk)] * 2 + [layout.shape(N, B, H, dv, C)] * 2
                      + [layout.shape(N, B, H, 1, C)] + [layout.shape(B, H, dv, dk)] * 3,
            scratch_shapes=[pltpu.VMEM((dv, dk), _F32)] * 3
                           + [pltpu.VMEM((C // S, dv, dk), _F32)] * 2
                           + [pltpu.VMEM((S + 1, dv, dk), _F32)] * 2,
            interpret=interpret,
            name="palimpsa_backward_tpu",
        )(layout.state(prior, 1.0), *layout.inputs, *(layout.state(x) for x in boundary_states),
          *cotangents,
          *(layout.state(x) for x in d_final_state))
    time_major = lambda x: jnp.swapaxes(x, -1, -2)[..., :layout.dv]
    d_log_alpha = d_alpha[..., 0, :] * layout.alpha
    grads = (dq[..., :layout.dk], dk_[..., :layout.dk], time_major(dv_), time_major(dbeta),
             d_log_alpha)
    d_chunks = tuple(g.astype(x.dtype) for g, x in zip(grads, chunks))
    d_prior = jnp.sum(layout.unstate(d_prior), axis=0)
    return d_chunks, d_prior, (layout.unstate(dM0), layout.unstate(dIbar0))


def palimpsa_pallas_tpu(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, *, scale: float,
                        return_variance: bool, chunk_size: int = DEFAULT_CHUNK_SIZE,
                        interpret=False, sub_chunk: int | None = None):
    """Pallas TPU backend; same arguments and returns as `palimpsa_reference`.

    Forward and backward are Mosaic kernels under the shared chunked custom VJP. Any positive
    chunk_size is valid (blocks span the whole chunk); 128 fills the lanes of the (Dv', C) blocks.
    `interpret=True` (or a `pltpu.InterpretParams`) runs the kernels in Pallas TPU interpret mode
    on any platform.
    """
    validation.check_platform("pallas_tpu", "tpu", interpret)
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int for pallas_tpu, got {chunk_size!r}")
    _sub_chunk(chunk_size, sub_chunk)
    return chunk.chunked(
        q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, scale=scale,
        return_variance=return_variance, chunk_size=chunk_size,
        forward=functools.partial(forward, interpret=interpret),
        backward=functools.partial(backward, interpret=interpret, sub_chunk=sub_chunk))
