"""The memory probe: the kernel inputs of every recurrent layer of a model on given tokens.

`probe(model, tokens)` runs the model once with its memories recording (`layers.memory.record`)
and returns the logits and, per layer, what its kernel received: q, k, v, log_alpha (every
recurrent mixer), beta and the prior (the Bayesian memory), the read-out scale and the segment
ids. Everything the analysis reports (gates, windows, importance, posterior means, predictive
variance) is computed from these by the kernels themselves, so there is one implementation of
each mixer, the one that trains.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

Array = jax.Array


class Probe(NamedTuple):
    """logits (B, T, V) float32 and layers: {layer index: {name: array}} for the layers with a
    recurrent memory (attention layers have none)."""
    logits: Array
    layers: dict[int, dict[str, Array]]


def probe(model: nnx.Module, tokens: Array, segment_ids: Array | None = None) -> Probe:
    """Runs a `CausalLM` on tokens (B, T) with its memories recording their kernel inputs."""
    model.set_attributes(probe=True, raise_if_not_found=False)
    try:
        if hasattr(nnx, "capture"):          # flax >= 0.12.6
            (logits, _), sown = nnx.capture(model, nnx.Intermediate)(tokens,
                                                                     segment_ids=segment_ids)
        else:
            logits, _ = model(tokens, segment_ids=segment_ids)
            sown = nnx.pop(model, nnx.Intermediate)
    finally:
        model.set_attributes(probe=False, raise_if_not_found=False)
    layers: dict[int, dict[str, Array]] = {}
    for path, value in nnx.to_flat_state(sown):          # ("blocks", i, ..., "kernel_inputs")
        value = value.get_value() if isinstance(value, nnx.Variable) else value
        layers[path[1]] = value[0]                       # sown values are tuples of calls
    return Probe(logits, dict(sorted(layers.items())))
