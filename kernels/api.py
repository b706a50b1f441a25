"""Public entry points: argument checks, state conventions and backend dispatch (README
"The kernel API").

Backends receive float32 gates with resets folded in (`chunking.resets`: a (B, T, H) mask, True
where a segment id changes or alpha = 0, and log_alpha 0 there), the Palimpsa prior as an
(H, Dv, Dk) float32 array and the state in natural parameters (M, Ibar) as float32; they return
outputs in float32 or in v's dtype (which the entry points return) and float32 states.
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from palimpsa_jax.kernels import chunking, validation
from palimpsa_jax.kernels.gated_deltanet.chunk import gated_delta_chunked
from palimpsa_jax.kernels.gated_deltanet.naive import gated_delta_reference
from palimpsa_jax.kernels.gated_deltanet.pallas_gpu import gated_delta_pallas_gpu
from palimpsa_jax.kernels.gla.chunk import gla_chunked
from palimpsa_jax.kernels.gla.naive import gla_reference
from palimpsa_jax.kernels.gla.pallas_gpu import gla_pallas_gpu
from palimpsa_jax.kernels.outputs import AttentionOutput, Posterior
from palimpsa_jax.kernels.palimpsa.chunk import palimpsa_chunked
from palimpsa_jax.kernels.palimpsa.naive import palimpsa_reference
from palimpsa_jax.kernels.palimpsa.pallas_gpu import palimpsa_pallas_gpu
from palimpsa_jax.kernels.palimpsa.pallas_tpu import palimpsa_pallas_tpu

PALIMPSA_BACKENDS = {
    "reference": palimpsa_reference,
    "xla": palimpsa_chunked,
    "pallas_gpu": palimpsa_pallas_gpu,
    "pallas_tpu": palimpsa_pallas_tpu,
}
GLA_BACKENDS = {
    "reference": gla_reference,
    "xla": gla_chunked,
    "pallas_gpu": gla_pallas_gpu,
}
GATED_DELTA_BACKENDS = {
    "reference": gated_delta_reference,
    "xla": gated_delta_chunked,
    "pallas_gpu": gated_delta_pallas_gpu,
}
PRIOR_LAYOUTS = ("(H,)", "(H, Dv)", "(H, Dv, Dk)")


def resolve_backend(backend: str, registry: dict, **options):
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


def full_prior(prior, heads: int, dv: int, dk: int):
    """The checked prior precision as an (H, Dv, Dk) float32 array.

    prior: (H,) one per head, (H, Dv) one per value row, or (H, Dv, Dk) one per synapse; > 0.
    """
    validation.check_floating("prior", prior)
    shapes = ((heads,), (heads, dv), (heads, dv, dk))
    if tuple(jnp.shape(prior)) not in shapes:
        raise ValueError(f"prior must have shape (H,) = {shapes[0]}, (H, Dv) = {shapes[1]} or "
                         f"(H, Dv, Dk) = {shapes[2]}, got {tuple(jnp.shape(prior))}")
    validation.check_values("prior", prior, lambda p: p > 0, "> 0 everywhere")
    prior = jnp.asarray(prior, jnp.float32)
    prior = prior.reshape(prior.shape + (1,) * (3 - prior.ndim))
    return jnp.broadcast_to(prior, (heads, dv, dk))


def _initial_memory(initial_state, shape):
    """The checked float32 initial state S_0 (B, H, Dv, Dk) of a single-matrix memory; 0 if None."""
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    validation.check_floating("initial_state", initial_state)
    validation.check_shape("initial_state", initial_state, shape, "(B, H, Dv, Dk)")
    validation.check_values("initial_state", initial_state)
    return jnp.asarray(initial_state, jnp.float32)


def _result(o, v, final_state, variance, return_final_state: bool, return_variance: bool):
    """o alone when no extra was asked for, else an AttentionOutput."""
    o = o.astype(v.dtype)
    if not (return_final_state or return_variance):
        return o
    return AttentionOutput(o, final_state if return_final_state else None,
                           variance if return_variance else None)


def palimpsa_attention(q, k, v, beta, log_alpha, prior, *, scale=None, initial_state=None,
                       segment_ids=None, return_final_state=False, return_variance=False,
                       backend="auto", chunk_size=None, interpret=None):
    """Metaplastic attention: o_t = scale (M_t / (Ibar_t + prior)) q_t (arXiv 2602.09075).

    Args:
      q, k: (B, T, H, Dk); v, beta: (B, T, H, Dv) with q's dtype; log_alpha: (B, T, H) <= 0
        (-inf allowed: alpha = 0, a full reset).
      prior: the prior precision I_prior > 0, (H,), (H, Dv) or (H, Dv, Dk).
      scale: read-out scale, default Dk ** -0.5.
      initial_state: optional (mu, I), each (B, H, Dv, Dk); default mu = 0, I = prior.
      segment_ids: optional (B, T) integers; the state resets at every change of id.
      return_final_state: also return the final `Posterior` (mu, I), float32.
      return_variance: also return the predictive variance (B, T, H, Dv), float32.
      backend: "reference", "xla", "pallas_gpu", "pallas_tpu" or "auto" (pallas_gpu on GPUs,
        pallas_tpu on TPUs, else xla).
      chunk_size: tokens per chunk for the chunked backends (backend default if None).
      interpret: Pallas backends only; True runs the kernel in Pallas interpret mode (any platform).
    Returns:
      o (B, T, H, Dv) in v's dtype if no extra is asked for, else an `AttentionOutput`
      (o, final_state, variance) with None for what was not asked for.
    """
    batch, length, heads, dk, dv = validation.check_qkv(q, k, v, log_alpha)
    validation.check_shape("beta", beta, (batch, length, heads, dv), "(B, T, H, Dv)")
    validation.check_same_dtype("q", q, beta=beta)
    validation.check_values("beta", beta, lambda b: b >= 0, ">= 0 everywhere")
    prior = full_prior(prior, heads, dv, dk)
    validation.check_segment_ids(segment_ids, batch, length)
    validation.check_scale(scale)
    fn, options = resolve_backend(backend, PALIMPSA_BACKENDS, chunk_size=chunk_size,
                                  interpret=interpret)

    scale = dk**-0.5 if scale is None else float(scale)
    state_shape = (batch, heads, dv, dk)
    if initial_state is None:
        M0 = Ibar0 = jnp.zeros(state_shape, jnp.float32)
    else:
        validation.check_state("initial_state", initial_state, state_shape, ("mu", "I"))
        mu0, I0 = (jnp.asarray(x, jnp.float32) for x in initial_state)
        validation.check_values("initial_state[I]", I0, lambda i: i > 0, "> 0 everywhere")
        M0, Ibar0 = mu0 * I0, I0 - prior

    reset, log_alpha = chunking.resets(segment_ids, log_alpha)
    o, variance, M, Ibar = fn(q, k, v, beta, log_alpha, prior, M0, Ibar0, reset, scale=scale,
                              return_variance=return_variance, **options)
    importance = Ibar + prior
    return _result(o, v, Posterior(M / importance, importance), variance, return_final_state,
                   return_variance)


def gla_attention(q, k, v, log_alpha, *, scale=None, initial_state=None, segment_ids=None,
                  return_final_state=False, backend="auto", chunk_size=None, interpret=None):
    """Gated linear attention: S_t = alpha_t S_{t-1} + v_t ⊗ k_t, o_t = scale S_t q_t.

    Args:
      q, k: (B, T, H, Dk); v: (B, T, H, Dv) with q's dtype; log_alpha: (B, T, H) <= 0.
      initial_state: optional S_0 (B, H, Dv, Dk), default 0. Other arguments as
      `palimpsa_attention`.
    Returns:
      o (B, T, H, Dv) in v's dtype, or with return_final_state an `AttentionOutput` whose
      final_state is S_T (B, H, Dv, Dk) float32 (variance None).
    """
    batch, length, heads, dk, dv = validation.check_qkv(q, k, v, log_alpha)
    validation.check_segment_ids(segment_ids, batch, length)
    validation.check_scale(scale)
    fn, options = resolve_backend(backend, GLA_BACKENDS, chunk_size=chunk_size,
                                  interpret=interpret)

    scale = dk**-0.5 if scale is None else float(scale)
    S0 = _initial_memory(initial_state, (batch, heads, dv, dk))
    reset, log_alpha = chunking.resets(segment_ids, log_alpha)
    o, S = fn(q, k, v, log_alpha, S0, reset, scale=scale, **options)
    return _result(o, v, S, None, return_final_state, False)


def gated_delta_attention(q, k, v, beta, log_alpha, *, scale=None, initial_state=None,
                          segment_ids=None, return_final_state=False, backend="auto",
                          chunk_size=None, interpret=None):
    """Gated DeltaNet: S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ, o_t = scale S_t q_t.

    Args:
      q, k: (B, T, H, Dk); v: (B, T, H, Dv) with q's dtype. Callers normally L2-normalise q and
      k per head (the layer does, the kernel does not).
      beta: (B, T, H) >= 0, the scalar write strength (typically a sigmoid output, not clipped).
      log_alpha: (B, T, H) <= 0. The gates are computed in float32 whatever their dtype.
      initial_state: optional S_0 (B, H, Dv, Dk), default 0. segment_ids: optional (B, T)
      integers; the state resets to 0 at every change of id.
      backend: "reference" (sequential scan), "xla" (chunked WY form), "pallas_gpu" (the WY
      form as Pallas Triton kernels) or "auto" (pallas_gpu on GPUs, else xla).
      chunk_size: tokens per chunk for the chunked backends (default 64 for xla, 32 for
      pallas_gpu). Other arguments as `palimpsa_attention`.
    Returns:
      o (B, T, H, Dv) in v's dtype, or with return_final_state an `AttentionOutput` whose
      final_state is S_T (B, H, Dv, Dk) float32 (variance None).
    """
    batch, length, heads, dk, dv = validation.check_qkv(q, k, v, log_alpha)
    validation.check_shape("beta", beta, (batch, length, heads), "(B, T, H)")
    validation.check_floating("beta", beta)
    validation.check_values("beta", beta, lambda b: b >= 0, ">= 0 everywhere")
    validation.check_segment_ids(segment_ids, batch, length)
    validation.check_scale(scale)
    fn, options = resolve_backend(backend, GATED_DELTA_BACKENDS, chunk_size=chunk_size,
                                  interpret=interpret)

    scale = dk**-0.5 if scale is None else float(scale)
    S0 = _initial_memory(initial_state, (batch, heads, dv, dk))
    reset, log_alpha = chunking.resets(segment_ids, log_alpha)
    o, S = fn(q, k, v, jnp.asarray(beta, jnp.float32), log_alpha, S0, reset, scale=scale,
              **options)
    return _result(o, v, S, None, return_final_state, False)
