"""Chunked pure-JAX (XLA) backend with a memory-efficient custom VJP.

A `lax.scan` walks the chunks; inside a chunk the states after every token are formed in
parallel with one matrix multiply, decay (C x C) @ [v ⊗ k | beta ⊗ k²] (C x 2·Dv·Dk), then read
out. The forward saves only the inputs and the (M, Ibar) state entering each chunk, so the saved
residuals are O(B·H·(T/C)·Dv·Dk); the backward walks the chunks in reverse and recomputes each one
under `jax.vjp`. The custom VJP is shared: a Pallas kernel can supply the forward (`chunked`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking
from palimpsa_jax.kernels.palimpsa.naive import readout

DEFAULT_CHUNK_SIZE = 64
_HIGHEST = jax.lax.Precision.HIGHEST


def _chunk_step(state, chunk, prior, reset, *, scale: float, return_variance: bool):
    """One chunk: (M_in, Ibar_in) each (B, H, Dv, Dk) -> (M_out, Ibar_out), (o, variance).

    chunk = (q, k, v, beta, log_alpha) with q, k: (B, H, C, Dk); v, beta: (B, H, C, Dv);
    log_alpha: (B, H, C); reset: (B, H, C) bool; prior: (H, Dv, Dk).
    """
    M_in, Ibar_in = state
    q, k, v, beta, log_alpha = (x.astype(jnp.float32) for x in chunk)
    (v, beta), (k, log_alpha), poisoned = chunking.finite_inputs((v, beta), (k, log_alpha))
    decay, from_start = chunking.chunk_decays(log_alpha, reset)
    batch, heads, size, dv = v.shape
    dk = k.shape[-1]
    updates = jnp.concatenate([
        (v[..., :, None] * k[..., None, :]).reshape(batch, heads, size, dv * dk),
        (beta[..., :, None] * (k * k)[..., None, :]).reshape(batch, heads, size, dv * dk),
    ], axis=-1)
    summed = jnp.einsum("bhts,bhsx->bhtx", decay, updates, precision=_HIGHEST)
    M_intra, Ibar_intra = jnp.split(summed.reshape(batch, heads, size, 2 * dv, dk), 2, axis=-2)
    M = from_start[..., None, None] * M_in[:, :, None] + M_intra
    Ibar = from_start[..., None, None] * Ibar_in[:, :, None] + Ibar_intra
    o, variance = readout(M, Ibar, prior[:, None], q, scale, return_variance)
    out = (chunking.poison(o, poisoned),
           None if variance is None else chunking.poison(variance, poisoned))
    last = poisoned[..., -1, :]
    return (chunking.poison(M[:, :, -1], last), chunking.poison(Ibar[:, :, -1], last)), out


def xla_forward(chunks, prior, state, reset, *, scale: float, return_variance: bool):
    """Chunked forward as a `lax.scan` over chunks.

    Args:
      chunks: (q, k, v, beta, log_alpha) in chunk layout (N, B, H, C, ...); prior: (H, Dv, Dk)
      float32; state: (M0, Ibar0), each (B, H, Dv, Dk) float32; reset: (N, B, H, C) bool.
    Returns:
      (o, variance or None) in chunk layout (float32), the final (M, Ibar), and the states
      entering each chunk, each (N, B, H, Dv, Dk).
    """
    def body(state_in, xs):
        chunk, reset_c = xs
        state_out, out = _chunk_step(state_in, chunk, prior, reset_c, scale=scale,
                                     return_variance=return_variance)
        return state_out, (out, state_in)

    final_state, (out, boundary_states) = jax.lax.scan(body, state, (chunks, reset))
    return out, final_state, boundary_states


def xla_backward(chunks, prior, boundary_states, reset, d_out, d_final_state, *, scale: float,
                 return_variance: bool):
    """Reverse scan over chunks, recomputing each from its saved entering state under jax.vjp.

    Args: the forward's inputs and residuals (see `xla_forward`), d_out = (d_o, d_variance or
    None) in chunk layout and d_final_state = (dM, dIbar). Returns (d_chunks, d_prior, d_state).
    """
    def body(carry, xs):
        d_state_out, d_prior = carry
        chunk, state_in, reset_c, d_out_c = xs
        step = functools.partial(_chunk_step, reset=reset_c, scale=scale,
                                 return_variance=return_variance)
        _, vjp = jax.vjp(step, state_in, chunk, prior)
        d_state_in, d_chunk, d_prior_c = vjp((d_state_out, d_out_c))
        return (d_state_in, d_prior + d_prior_c), d_chunk

    (d_state, d_prior), d_chunks = jax.lax.scan(
        body, (d_final_state, jnp.zeros_like(prior)), (chunks, boundary_states, reset, d_out),
        reverse=True)
    return d_chunks, d_prior, d_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked(chunks, prior, state, reset, scale, return_variance, forward, backward):
    out, final_state, _ = forward(chunks, prior, state, reset, scale=scale,
                                  return_variance=return_variance)
    return out, final_state


def _chunked_fwd(chunks, prior, state, reset, scale, return_variance, forward, backward):
    out, final_state, boundary_states = forward(chunks, prior, state, reset, scale=scale,
                                                return_variance=return_variance)
    return (out, final_state), (chunks, prior, boundary_states, reset)


def _chunked_bwd(scale, return_variance, forward, backward, residuals, cotangents):
    chunks, prior, boundary_states, reset = residuals
    d_out, d_final_state = cotangents
    d_chunks, d_prior, d_state = backward(chunks, prior, boundary_states, reset, d_out,
                                          d_final_state, scale=scale,
                                          return_variance=return_variance)
    return d_chunks, d_prior, d_state, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, *, scale: float,
            return_variance: bool, chunk_size: int, forward=xla_forward, backward=xla_backward):
    """Runs a chunked `forward` and `backward` (XLA or Pallas kernels) as one custom VJP.

    Same arguments and returns as `palimpsa_reference` (`kernels.palimpsa.naive`).
    """
    chunks, reset = chunking.split_chunks((q, k, v, beta, log_alpha), reset, chunk_size)
    (o, variance), (M, Ibar) = _chunked(chunks, prior, (M0, Ibar0), reset, scale,
                                        return_variance, forward, backward)
    length = q.shape[1]
    if variance is not None:
        variance = chunking.from_chunks(variance, length)
    return chunking.from_chunks(o, length), variance, M, Ibar


def palimpsa_chunked(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, *, scale: float,
                     return_variance: bool, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Chunked XLA backend; same arguments and returns as `palimpsa_reference`."""
    return chunked(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, scale=scale,
                   return_variance=return_variance, chunk_size=chunk_size)
