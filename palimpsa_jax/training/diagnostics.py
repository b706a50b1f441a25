"""Metaplasticity diagnostics of a model on one batch, per layer and head, from the memory probe
(`palimpsa_jax.analysis.probe`): the memory window N = 1 / (1 - alpha) (median over tokens), the
importance I of the memory after the batch (mean, min, max over sequences and synapses), its
ratio to the prior (minimum, the metaplasticity ratio q90/q10, and a histogram of log10(I /
prior) per layer) and softplus(b_scale); and the histogram of each layer's prior."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from palimpsa_jax.analysis import measures, probe
from palimpsa_jax.analysis.posterior import final_posterior

Array = jax.Array
# log10(I / prior) from 0 (the prior) to 4; importance never falls below the prior
RATIO_EDGES = np.linspace(0.0, 4.0, 41)     # numpy: importing this module starts no backend
HISTOGRAMS = "histogram/"     # keys of histogram counts (not per-head scalars)


def metaplasticity(model: nnx.Module, tokens: Array, segment_ids: Array | None = None
                   ) -> dict[str, Array]:
    """{"layer_03/importance_mean": (H,), ...} for every block of a CausalLM.

    Keys per layer: memory_window (median over tokens; every recurrent mixer); importance_mean,
    _min, _max, importance_over_prior_min (which the recurrence keeps >= 1),
    metaplasticity_ratio and b_scale (metaplastic mixers only; b_scale where the beta module
    has one); and, under "histogram/", the counts of log10(I / prior) in RATIO_EDGES per layer.
    Attention layers have none.
    """
    out = {}
    for layer, inputs in probe(model, tokens, segment_ids).layers.items():
        name = f"layer_{layer:02d}"
        window = -1.0 / jnp.expm1(inputs["log_alpha"].astype(jnp.float32))       # (B, T, H)
        out[f"{name}/memory_window"] = jnp.median(window.reshape(-1, window.shape[-1]), axis=0)
        if "beta" in inputs and "prior" in inputs:
            importance = final_posterior(inputs).importance                     # (B, H, Dv, Dk)
            prior = inputs["prior"]
            prior = prior.reshape(prior.shape + (1,) * (3 - prior.ndim))
            out[f"{name}/importance_mean"] = jnp.mean(importance, axis=(0, 2, 3))
            out[f"{name}/importance_min"] = jnp.min(importance, axis=(0, 2, 3))
            out[f"{name}/importance_max"] = jnp.max(importance, axis=(0, 2, 3))
            ratio = importance / prior
            out[f"{name}/importance_over_prior_min"] = jnp.min(ratio, axis=(0, 2, 3))
            out[f"{name}/metaplasticity_ratio"] = measures.metaplasticity_ratio(
                importance, inputs["prior"])
            out[f"{HISTOGRAMS}{name}/log10_importance_over_prior"] = jnp.histogram(
                jnp.log10(ratio), bins=RATIO_EDGES)[0]
            beta = getattr(model.blocks[layer].mixer, "beta", None)
            if hasattr(beta, "b_scale"):          # the built-in BetaProjection; prototypes may differ
                out[f"{name}/b_scale"] = jax.nn.softplus(beta.b_scale[...])
    return out


def per_head_scalars(diagnostics: dict[str, Array]) -> dict[str, float]:
    """{"metaplasticity/layer_03/importance_mean/head_07": value, ...} plus the mean over heads
    under ".../mean" for each key (histogram counts left out)."""
    scalars = {}
    for name, values in diagnostics.items():
        if name.startswith(HISTOGRAMS):
            continue
        values = jnp.asarray(values)
        for head, value in enumerate(values):
            scalars[f"metaplasticity/{name}/head_{head:02d}"] = value
        scalars[f"metaplasticity/{name}/mean"] = jnp.mean(values)
    return scalars


def write_histograms(writer, step: int, model: nnx.Module, diagnostics: dict[str, Array]) -> None:
    """The histograms to TensorBoard: log10(I / prior) per layer (from `metaplasticity`) and
    each Bayesian layer's prior, as `metaplasticity/<layer>/...`."""
    for name, counts in diagnostics.items():
        if name.startswith(HISTOGRAMS):
            writer.histogram(step, f"metaplasticity/{name[len(HISTOGRAMS):]}", RATIO_EDGES, counts)
    for i, block in enumerate(model.blocks):
        prior = getattr(getattr(block.mixer, "memory", None), "prior", None)
        if prior is not None:
            values = np.asarray(prior()).ravel()
            edges = np.linspace(values.min(), values.max() + 1e-6, 21)
            writer.histogram(step, f"metaplasticity/layer_{i:02d}/prior", edges,
                             np.histogram(values, bins=edges)[0])
