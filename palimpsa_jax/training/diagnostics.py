"""Metaplasticity diagnostics of a model on one batch, per layer and head (SPEC sections 1, 3):
the importance I of the memory after the batch (mean, min, max over sequences and synapses), the
memory window N = 1 / (1 - alpha) averaged over tokens, and softplus(b_scale)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array


def metaplasticity(model: nnx.Module, tokens: Array, segment_ids: Array | None = None
                   ) -> dict[str, Array]:
    """{"layer_03/importance_mean": (H,), ...} for every block of a CausalLM.

    Keys per layer: memory_window (every recurrent mixer); importance_mean / _min / _max and
    b_scale (metaplastic mixers only). Attention layers have none.
    """
    model.set_attributes(diagnose=True, raise_if_not_found=False)
    try:
        if hasattr(nnx, "capture"):          # flax >= 0.12.6
            _, sown = nnx.capture(model, nnx.Intermediate)(tokens, segment_ids=segment_ids)
        else:
            model(tokens, segment_ids=segment_ids)
            sown = nnx.pop(model, nnx.Intermediate)
    finally:
        model.set_attributes(diagnose=False, raise_if_not_found=False)
    out = {}
    for path, value in nnx.to_flat_state(sown):
        value = value.get_value() if isinstance(value, nnx.Variable) else value
        out[f"layer_{path[1]:02d}/{path[-1]}"] = value[0]
    for i, block in enumerate(model.blocks):
        memory = getattr(block.mixer, "memory", None)
        if getattr(memory, "metaplasticity", False):
            out[f"layer_{i:02d}/b_scale"] = jax.nn.softplus(memory.b_scale[...])
    return out


def per_head_scalars(diagnostics: dict[str, Array]) -> dict[str, float]:
    """{"metaplasticity/layer_03/importance_mean/head_07": value, ...} plus the mean over heads
    under ".../mean" for each key."""
    scalars = {}
    for name, values in diagnostics.items():
        values = jnp.asarray(values)
        for head, value in enumerate(values):
            scalars[f"metaplasticity/{name}/head_{head:02d}"] = value
        scalars[f"metaplasticity/{name}/mean"] = jnp.mean(values)
    return scalars
