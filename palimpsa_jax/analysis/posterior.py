"""What a layer's memory holds, from its probed kernel inputs (`probe`): the posterior (mu, I)
after the last token or at chosen positions, the mean importance along the sequence, the
predictive variance of every output. All are computed by `palimpsa_jax.kernels` (per shard
under an active mesh), the same kernels the layers train with.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax import kernels
from palimpsa_jax.analysis.measures import memory_window
from palimpsa_jax.analysis.probe import probe
from palimpsa_jax.kernels import Posterior
from palimpsa_jax.layers.memory import run_kernel

ARRAYS = ("q", "k", "v", "beta", "log_alpha")
Array = jax.Array


def _palimpsa(inputs: dict, *, length: int | None = None, backend: str = "auto", **extras):
    """palimpsa_attention on the probed inputs (the first `length` tokens), read-out scale 1."""
    cut = (lambda x: x) if length is None else (lambda x: x[:, :length])
    segment_ids = inputs.get("segment_ids")
    return run_kernel(kernels.palimpsa_attention, tuple(cut(inputs[n]) for n in ARRAYS),
                      prior=inputs["prior"], scale=1.0, options={"backend": backend},
                      segment_ids=None if segment_ids is None else cut(segment_ids), **extras)


def final_posterior(inputs: dict, *, backend: str = "auto") -> Posterior:
    """The (mu, I) of a Bayesian memory after the last token, each (B, H, Dv, Dk) float32."""
    return Posterior(*_palimpsa(inputs, backend=backend, return_final_state=True).final_state)


def posterior_at(inputs: dict, positions: Sequence[int], *, backend: str = "auto") -> Posterior:
    """The (mu, I) after each token of `positions`, each (B, P, H, Dv, Dk) float32."""
    states = [_palimpsa(inputs, length=p + 1, backend=backend,
                        return_final_state=True).final_state for p in positions]
    return Posterior(*(jnp.stack(parts, axis=1) for parts in zip(*states)))


def mean_importance(inputs: dict, *, backend: str = "auto") -> Array:
    """The importance after every token averaged over the Dv x Dk synapses, (B, T, H) float32.

    Exact and cheap: Ibar_t = sum_s w_ts beta_s ⊗ k_s² averages to sum_s w_ts mean(beta_s)
    mean(k_s²), a one-element gated linear recurrence; I = Ibar + prior.
    """
    f32 = lambda x: x.astype(jnp.float32)
    k2 = jnp.mean(f32(inputs["k"]) ** 2, axis=-1, keepdims=True)
    beta = jnp.mean(f32(inputs["beta"]), axis=-1, keepdims=True)
    ones = jnp.ones_like(k2)
    ibar = run_kernel(kernels.gla_attention, (ones, k2, beta, inputs["log_alpha"]), scale=1.0,
                      segment_ids=inputs.get("segment_ids"), options={"backend": backend}).o
    prior = jnp.asarray(inputs["prior"])
    return ibar[..., 0] + jnp.mean(prior.reshape(prior.shape[0], -1), axis=-1)


def predictive_variance(inputs: dict, *, backend: str = "auto") -> Array:
    """scale² Σ_k q_k² / I[v, k] for every output, (B, T, H, Dv) float32."""
    variance = _palimpsa(inputs, backend=backend, return_variance=True).variance
    return inputs["scale"] ** 2 * variance


class LayerMemory(NamedTuple):
    """What one recurrent layer's memory did on a batch (B, T tokens).

    alpha, window: (B, T, H) forget gate exp(log_alpha) and window 1 / (1 - alpha);
    the rest only for a Bayesian memory (None otherwise): beta (B, T, H, Dv), prior (H,),
    (H, Dv) or (H, Dv, Dk), mean_importance (B, T, H), variance (B, T, H, Dv), final (the
    Posterior after the last token, (B, H, Dv, Dk) each) and at (the Posterior after each of the
    requested positions, (B, P, H, Dv, Dk) each, or None).
    """
    alpha: Array
    window: Array
    beta: Array | None = None
    prior: Array | None = None
    mean_importance: Array | None = None
    variance: Array | None = None
    final: Posterior | None = None
    at: Posterior | None = None


def inspect(model: nnx.Module, tokens: Array, segment_ids: Array | None = None,
            positions: Sequence[int] | None = None, *, backend: str = "auto"
            ) -> tuple[Array, dict[int, LayerMemory]]:
    """Runs a `CausalLM` on tokens (B, T) and returns its logits and, per recurrent layer,
    its `LayerMemory`. Jit it with positions static (`nnx.jit(inspect, static_argnums=3)`)."""
    result = probe(model, tokens, segment_ids)
    layers = {}
    for layer, inputs in result.layers.items():
        log_alpha = inputs["log_alpha"].astype(jnp.float32)
        memory = LayerMemory(alpha=jnp.exp(log_alpha), window=memory_window(log_alpha))
        if "beta" in inputs and "prior" in inputs:
            memory = memory._replace(
                beta=inputs["beta"].astype(jnp.float32), prior=inputs["prior"],
                mean_importance=mean_importance(inputs, backend=backend),
                variance=predictive_variance(inputs, backend=backend),
                final=final_posterior(inputs, backend=backend),
                at=None if positions is None else posterior_at(inputs, positions, backend=backend))
        layers[layer] = memory
    return result.logits, layers
