"""Palimpsa compute core, independent of Flax.

`palimpsa_attention` (metaplastic) and `gla_attention` (non-metaplastic) dispatch to backends:
a sequential reference (`kernels.palimpsa.naive`, `kernels.gla.naive`) and a chunked pure-JAX
path (`kernels.palimpsa.chunk`, `kernels.gla.chunk`). `kernels.rules` holds the sequential
update rules of the unified Bayesian view (Mamba2, DeltaNet, Gated DeltaNet, Longhorn, Mesa,
Palimpsa).
"""
from kernels.api import GLA_BACKENDS, PALIMPSA_BACKENDS, gla_attention, palimpsa_attention

__all__ = ["palimpsa_attention", "gla_attention", "PALIMPSA_BACKENDS", "GLA_BACKENDS"]
