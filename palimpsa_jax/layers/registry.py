"""Mixers and beta rules by name, so an experiment defines its own without editing the library.

A mixer factory is called as `factory(config: ModelConfig, *, dtype, rngs) -> nnx.Module`,
the module following the mixer contract of `palimpsa_jax.layers` (`y, cache = mixer(x,
segment_ids=None, cache=None)` and `init_cache(batch, max_length, dtype)`). A beta rule factory
is called as `factory(d_model, num_heads, dv, *, rank, std, dtype, rngs) -> nnx.Module` whose
call `beta(x, input_gate)` gives the Bayesian memory's precision (B, T, H, Dv) >= 0 (the
built-in "low_rank" is `layers.BetaProjection`).

`ModelConfig.mixers` and `ModelConfig.beta_rule` take a registered name or "module:attribute"
(an importable factory, e.g. "my_project.mixers:MyMixer"), so a run's config.json names
everything needed to rebuild it. An experiment file registers at import:

    from palimpsa_jax.layers import register_mixer
    register_mixer("my_mixer", lambda config, **kw: MyMixer(config.d_model, ..., **kw))
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

MIXERS: dict[str, Callable] = {}
BETA_RULES: dict[str, Callable] = {}


def _register(table: dict, kind: str, name: str, factory: Callable | None):
    def add(factory):
        if not callable(factory):
            raise ValueError(f"{kind} {name!r}: the factory must be callable, got {factory!r}")
        if ":" in name:
            raise ValueError(f"{kind} name {name!r} must not contain ':' (that form names a "
                             "module:attribute)")
        table[name] = factory
        return factory
    return add if factory is None else add(factory)


def register_mixer(name: str, factory: Callable | None = None):
    """Registers a mixer factory under `name` (replacing one of that name); also a decorator."""
    return _register(MIXERS, "mixer", name, factory)


def register_beta_rule(name: str, factory: Callable | None = None):
    """Registers a beta rule factory under `name`; also a decorator."""
    return _register(BETA_RULES, "beta rule", name, factory)


def resolve(table: dict, kind: str, name: str) -> Callable:
    """The factory of a registered name or of "module:attribute"; ValueError naming it."""
    if name in table:
        return table[name]
    if ":" in name:
        module, _, attribute = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{kind} {name!r} cannot be imported: {e}") from None
    raise ValueError(f"{kind} {name!r} is not registered (registered: {sorted(table)}) and is "
                     "not of the form module:attribute")
