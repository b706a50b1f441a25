"""Public entry points: argument checks, state conventions and backend dispatch (SPEC section 4).

Backends receive float32 gates and prior, the state in natural parameters (M, Ibar) as float32,
and a (B, T) bool reset mask built from segment ids; they return float32 outputs.
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from kernels import chunking, validation
from kernels.gated_deltanet import chunk as gated_delta_chunk
from kernels.gated_deltanet import naive as gated_delta_naive
from kernels.gla import chunk as gla_chunk
from kernels.gla import naive as gla_naive
from kernels.palimpsa import chunk as palimpsa_chunk
from kernels.palimpsa import naive as palimpsa_naive
from kernels.palimpsa import pallas_gpu as palimpsa_pallas_gpu
from kernels.palimpsa import pallas_tpu as palimpsa_pallas_tpu

PALIMPSA_BACKENDS = {
    "reference": palimpsa_naive.palimpsa,
    "xla": palimpsa_chunk.palimpsa,
    "pallas_gpu": palimpsa_pallas_gpu.palimpsa,
    "pallas_tpu": palimpsa_pallas_tpu.palimpsa,
}
GLA_BACKENDS = {
    "reference": gla_naive.gla,
    "xla": gla_chunk.gla,
}
GATED_DELTA_BACKENDS = {
    "reference": gated_delta_naive.gated_delta,
    "xla": gated_delta_chunk.gated_delta,
}


def _resolve(backend: str, registry: dict, **options):
    """Returns the backend function and the options given (not None), which it must accept.

    "auto" is the fastest backend of the current platform: pallas_gpu on GPUs, pallas_tpu on
    TPUs, else xla.
    """
    if backend == "auto":
        platform_backend = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend())
        backend = platform_backend if platform_backend in registry else "xla"
    if backend not in registry:
        raise ValueError(f"backend must be 'auto' or one of {sorted(registry)}, got {backend!r}")
    fn = registry[backend]
    options = {name: value for name, value in options.items() if value is not None}
    for name in options:
        if name not in inspect.signature(fn).parameters:
            raise ValueError(f"{name} is not an option of backend {backend!r}")
    return fn, options


def _initial_memory(initial_state, shape):
    """The checked float32 initial state S_0 (B, H, Dv, Dk) of a single-matrix memory; 0 if None."""
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    validation.check_floating("initial_state", initial_state)
    validation.check_shape("initial_state", initial_state, shape, "(B, H, Dv, Dk)")
    return jnp.asarray(initial_state, jnp.float32)


def palimpsa_attention(q, k, v, beta, log_alpha, prior, *, scale=None, initial_state=None,
                       segment_ids=None, return_final_state=False, return_variance=False,
                       backend="auto", chunk_size=None, interpret=None):
    """Metaplastic attention: o_t = scale (M_t / (Ibar_t + prior)) q_t (SPEC section 1).

    Args:
      q, k: (B, T, H, Dk); v, beta: (B, T, H, Dv) with q's dtype; log_alpha: (B, T, H) <= 0;
      prior: (H,) > 0.
      scale: read-out scale, default Dk ** -0.5.
      initial_state: optional (mu, I), each (B, H, Dv, Dk); default mu = 0, I = prior.
      segment_ids: optional (B, T) integers; the state resets at every change of id.
      return_final_state: also return the final (mu, I), float32.
      return_variance: also return the predictive variance (B, T, H, Dv), float32.
      backend: "reference", "xla", "pallas_gpu", "pallas_tpu" or "auto" (pallas_gpu on GPUs,
        pallas_tpu on TPUs, else xla).
      chunk_size: tokens per chunk for the chunked backends (backend default if None).
      interpret: Pallas backends only; True runs the kernel in Pallas interpret mode (any platform).
    Returns:
      o (B, T, H, Dv) in v's dtype, or the tuple (o, final_state, variance) holding only the
      requested extras in that order.
    """
    batch, length, heads, dk, dv = validation.check_qkv(q, k, v, log_alpha)
    validation.check_shape("beta", beta, (batch, length, heads, dv), "(B, T, H, Dv)")
    validation.check_same_dtype("q", q, beta=beta)
    validation.check_values("beta", beta, lambda b: b >= 0, ">= 0 everywhere")
    validation.check_shape("prior", prior, (heads,), "(H,)")
    validation.check_floating("prior", prior)
    validation.check_values("prior", prior, lambda p: p > 0, "> 0 for every head")
    validation.check_segment_ids(segment_ids, batch, length)
    validation.check_scale(scale)
    fn, options = _resolve(backend, PALIMPSA_BACKENDS, chunk_size=chunk_size, interpret=interpret)

    scale = dk**-0.5 if scale is None else float(scale)
    prior = jnp.asarray(prior, jnp.float32)
    state_shape = (batch, heads, dv, dk)
    if initial_state is None:
        M0 = Ibar0 = jnp.zeros(state_shape, jnp.float32)
    else:
        validation.check_state("initial_state", initial_state, state_shape, ("mu", "I"))
        mu0, I0 = (jnp.asarray(x, jnp.float32) for x in initial_state)
        validation.check_values("initial_state[I]", I0, lambda i: i > 0, "> 0 everywhere")
        M0, Ibar0 = mu0 * I0, I0 - prior[:, None, None]

    o, variance, M, Ibar = fn(q, k, v, beta, jnp.asarray(log_alpha, jnp.float32), prior, M0, Ibar0,
                              chunking.segment_resets(segment_ids, batch, length),
                              scale=scale, return_variance=return_variance, **options)
    o = o.astype(v.dtype)
    extras = []
    if return_final_state:
        importance = Ibar + prior[:, None, None]
        extras.append((M / importance, importance))
    if return_variance:
        extras.append(variance)
    return (o, *extras) if extras else o


def gla_attention(q, k, v, log_alpha, *, scale=None, initial_state=None, segment_ids=None,
                  return_final_state=False, backend="auto", chunk_size=None):
    """Gated linear attention: S_t = alpha_t S_{t-1} + v_t ⊗ k_t, o_t = scale S_t q_t.

    Args:
      q, k: (B, T, H, Dk); v: (B, T, H, Dv) with q's dtype; log_alpha: (B, T, H) <= 0.
      initial_state: optional S_0 (B, H, Dv, Dk), default 0. Other arguments as
      `palimpsa_attention`.
    Returns:
      o (B, T, H, Dv) in v's dtype, or (o, S_T) with S_T float32 if return_final_state.
    """
    batch, length, heads, dk, dv = validation.check_qkv(q, k, v, log_alpha)
    validation.check_segment_ids(segment_ids, batch, length)
    validation.check_scale(scale)
    fn, options = _resolve(backend, GLA_BACKENDS, chunk_size=chunk_size)

    scale = dk**-0.5 if scale is None else float(scale)
    S0 = _initial_memory(initial_state, (batch, heads, dv, dk))

    o, S = fn(q, k, v, jnp.asarray(log_alpha, jnp.float32), S0,
              chunking.segment_resets(segment_ids, batch, length), scale=scale, **options)
    o = o.astype(v.dtype)
    return (o, S) if return_final_state else o


def gated_delta_attention(q, k, v, beta, log_alpha, *, scale=None, initial_state=None,
                          segment_ids=None, return_final_state=False, backend="auto",
                          chunk_size=None):
    """Gated DeltaNet: S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ, o_t = scale S_t q_t.

    Args:
      q, k: (B, T, H, Dk); v: (B, T, H, Dv) with q's dtype. Callers normally L2-normalise q and
      k per head (the layer does, the kernel does not).
      beta: (B, T, H) >= 0, the scalar write strength (typically a sigmoid output, not clipped).
      log_alpha: (B, T, H) <= 0. The gates are computed in float32 whatever their dtype.
      initial_state: optional S_0 (B, H, Dv, Dk), default 0. segment_ids: optional (B, T)
      integers; the state resets to 0 at every change of id.
      backend: "reference" (sequential scan), "xla" (chunked WY form) or "auto" (xla).
      chunk_size: tokens per chunk for the chunked backend (default 64). Other arguments as
      `palimpsa_attention`.
    Returns:
      o (B, T, H, Dv) in v's dtype, or (o, S_T) with S_T float32 if return_final_state.
    """
    batch, length, heads, dk, dv = validation.check_qkv(q, k, v, log_alpha)
    validation.check_shape("beta", beta, (batch, length, heads), "(B, T, H)")
    validation.check_floating("beta", beta)
    validation.check_values("beta", beta, lambda b: b >= 0, ">= 0 everywhere")
    validation.check_segment_ids(segment_ids, batch, length)
    validation.check_scale(scale)
    fn, options = _resolve(backend, GATED_DELTA_BACKENDS, chunk_size=chunk_size)

    scale = dk**-0.5 if scale is None else float(scale)
    S0 = _initial_memory(initial_state, (batch, heads, dv, dk))

    o, S = fn(q, k, v, jnp.asarray(beta, jnp.float32), jnp.asarray(log_alpha, jnp.float32), S0,
              chunking.segment_resets(segment_ids, batch, length), scale=scale, **options)
    o = o.astype(v.dtype)
    return (o, S) if return_final_state else o
