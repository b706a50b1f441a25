"""Pallas GPU (Triton) forward of the metaplastic recurrence.

Grid (B, H, ceil(Dv / block_v)): each program keeps a (block_v, Dk') tile of the state (M, Ibar)
in registers (Dk' = Dk padded to a power of two, masked), walks the chunks in a `fori_loop` and
the C tokens of a chunk unrolled, so the loads of a chunk are independent of the state and can be
issued ahead of the recurrence. It writes outputs, the optional variance and the state entering
every chunk; those chunk-boundary states are the residuals of the shared chunked backward
(`kernels.palimpsa.chunk`), which recomputes each chunk in XLA.

Inputs and outputs use the chunk layout (N, B, H, C, ...) of `kernels.chunking`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.palimpsa import chunk

DEFAULT_BLOCK_V = 16
DEFAULT_NUM_WARPS = 4


def _kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, prior_ref, M0_ref, Ibar0_ref,
            o_ref, var_ref, M_bound_ref, Ibar_bound_ref, M_ref, Ibar_ref,
            *, scale: float, dk: int, dv: int):
    """One (b, h, v-tile) program. decay_ref holds alpha_t with resets already zeroed."""
    num_chunks, chunk_size, dk_pad = q_ref.shape
    block_v = v_ref.shape[-1]
    rows = pl.program_id(2) * block_v + jnp.arange(block_v)
    k_mask = jnp.arange(dk_pad) < dk
    v_mask = rows < dv
    tile_mask = v_mask[:, None] & k_mask[None, :]
    prior = prior_ref[pl.program_id(1)]
    M = plgpu.load(M0_ref, mask=tile_mask, other=0.0)
    Ibar = plgpu.load(Ibar0_ref, mask=tile_mask, other=0.0)
    token = jnp.arange(chunk_size)

    def chunk(n, state):
        M, Ibar = state
        plgpu.store(M_bound_ref.at[n], M, mask=tile_mask)
        plgpu.store(Ibar_bound_ref.at[n], Ibar, mask=tile_mask)
        alphas = decay_ref[n]
        for i in map(jnp.int32, range(chunk_size)):  # unrolled; array indices for interpret mode
            alpha = jnp.sum(jnp.where(token == i, alphas, 0.0))
            q = plgpu.load(q_ref.at[n, i], mask=k_mask, other=0.0).astype(jnp.float32)
            k = plgpu.load(k_ref.at[n, i], mask=k_mask, other=0.0).astype(jnp.float32)
            v = plgpu.load(v_ref.at[n, i], mask=v_mask, other=0.0).astype(jnp.float32)
            beta = plgpu.load(beta_ref.at[n, i], mask=v_mask, other=0.0).astype(jnp.float32)
            M = alpha * M + v[:, None] * k[None, :]
            Ibar = alpha * Ibar + beta[:, None] * (k * k)[None, :]
            plasticity = 1.0 / (Ibar + prior)
            o = scale * jnp.sum(M * plasticity * q[None, :], axis=1)
            plgpu.store(o_ref.at[n, i], o.astype(o_ref.dtype), mask=v_mask)
            if var_ref is not None:
                var = scale * scale * jnp.sum(plasticity * (q * q)[None, :], axis=1)
                plgpu.store(var_ref.at[n, i], var, mask=v_mask)
        return M, Ibar

    M, Ibar = jax.lax.fori_loop(0, num_chunks, chunk, (M, Ibar))
    plgpu.store(M_ref, M, mask=tile_mask)
    plgpu.store(Ibar_ref, Ibar, mask=tile_mask)


def forward(chunks, prior, state, reset, *, scale: float, return_variance: bool,
            interpret: bool = False, block_v: int = DEFAULT_BLOCK_V,
            num_warps: int = DEFAULT_NUM_WARPS):
    """Chunked forward; same contract as `kernels.palimpsa.chunk.xla_forward`.

    Args:
      chunks: (q, k, v, beta, log_alpha) in chunk layout, q, k: (N, B, H, C, Dk); v, beta:
        (N, B, H, C, Dv); log_alpha: (N, B, H, C). prior: (H,) float32.
      state: (M0, Ibar0), each (B, H, Dv, Dk) float32. reset: (N, B, 1, C) bool.
    Returns:
      (o, variance or None) in chunk layout (float32), the final (M, Ibar), and the states
      entering each chunk, each (N, B, H, Dv, Dk).
    """
    q, k, v, beta, log_alpha = chunks
    num_chunks, batch, heads, chunk_size, dk = q.shape
    dv = v.shape[-1]
    dk_pad = pl.next_power_of_2(dk)
    block_v = min(block_v, pl.next_power_of_2(dv))
    decay = jnp.where(reset, 0.0, jnp.exp(log_alpha))
    prior_pad = jnp.pad(prior, (0, pl.next_power_of_2(heads) - heads), constant_values=1.0)

    token_spec = lambda width: pl.BlockSpec(
        (num_chunks, None, None, chunk_size, width), lambda b, h, j: (0, b, h, 0, 0))
    value_spec = pl.BlockSpec((num_chunks, None, None, chunk_size, block_v),
                              lambda b, h, j: (0, b, h, 0, j))
    state_spec = pl.BlockSpec((None, None, block_v, dk_pad), lambda b, h, j: (b, h, j, 0))
    bound_spec = pl.BlockSpec((num_chunks, None, None, block_v, dk_pad),
                              lambda b, h, j: (0, b, h, j, 0))
    state_shape = jax.ShapeDtypeStruct((batch, heads, dv, dk), jnp.float32)
    bound_shape = jax.ShapeDtypeStruct((num_chunks, batch, heads, dv, dk), jnp.float32)
    out_shape = jax.ShapeDtypeStruct((num_chunks, batch, heads, chunk_size, dv), jnp.float32)

    with jax.enable_x64(False):  # the kernel indexes with int32 whatever the global setting
        outputs = pl.pallas_call(
            functools.partial(_kernel if return_variance else _without_variance, scale=scale,
                              dk=dk, dv=dv),
            grid=(batch, heads, pl.cdiv(dv, block_v)),
            in_specs=[token_spec(dk_pad), token_spec(dk_pad), value_spec, value_spec,
                      pl.BlockSpec((num_chunks, None, None, chunk_size), lambda b, h, j: (0, b, h, 0)),
                      pl.BlockSpec(prior_pad.shape, lambda b, h, j: (0,)),
                      state_spec, state_spec],
            out_specs=[value_spec] * (2 if return_variance else 1) + [bound_spec] * 2 + [state_spec] * 2,
            out_shape=[out_shape] * (2 if return_variance else 1) + [bound_shape] * 2 + [state_shape] * 2,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name="palimpsa_forward",
        )(q, k, v, beta, decay, prior_pad, *state)
    if return_variance:
        o, variance, M_bound, Ibar_bound, M, Ibar = outputs
    else:
        (o, M_bound, Ibar_bound, M, Ibar), variance = outputs, None
    return (o, variance), (M, Ibar), (M_bound, Ibar_bound)


def _without_variance(q_ref, k_ref, v_ref, beta_ref, decay_ref, prior_ref, M0_ref, Ibar0_ref,
                      o_ref, *refs, **kwargs):
    _kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, prior_ref, M0_ref, Ibar0_ref, o_ref, None,
            *refs, **kwargs)


def palimpsa(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, *, scale: float,
             return_variance: bool, chunk_size: int = 16, interpret: bool = False,
             block_v: int = DEFAULT_BLOCK_V, num_warps: int = DEFAULT_NUM_WARPS):
    """Pallas GPU backend; same arguments and returns as `kernels.palimpsa.naive.palimpsa`.

    The forward is the Pallas kernel; the backward is the shared chunked recompute in XLA.
    `interpret=True` runs the same kernel body in Pallas interpret mode on any platform.
    """
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError("backend 'pallas_gpu' needs a GPU (found "
                         f"{jax.default_backend()!r}); pass interpret=True to run it in Pallas "
                         "interpret mode")
    if chunk_size & (chunk_size - 1) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a power of two for pallas_gpu, got {chunk_size}")
    kernel = functools.partial(forward, interpret=interpret, block_v=block_v, num_warps=num_warps)
    return chunk.chunked(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, scale=scale,
                         return_variance=return_variance, chunk_size=chunk_size, forward=kernel)
