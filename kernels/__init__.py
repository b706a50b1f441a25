"""Palimpsa compute core, independent of Flax.

`palimpsa_attention` (metaplastic), `gla_attention` (non-metaplastic Mamba2 / simple GLA) and
`gated_delta_attention` (Gated DeltaNet) dispatch to backends: a sequential reference
(`naive.py`), a chunked pure-JAX path (`chunk.py`) and, for Palimpsa, Pallas kernels
(`kernels.palimpsa.pallas_gpu`, `kernels.palimpsa.pallas_tpu`). `kernels.rules` holds the sequential
update rules of the unified Bayesian view (Mamba2, DeltaNet, Gated DeltaNet, Longhorn, Mesa,
Palimpsa).
"""
from kernels.api import (GATED_DELTA_BACKENDS, GLA_BACKENDS, PALIMPSA_BACKENDS,
                         gated_delta_attention, gla_attention, palimpsa_attention)

__all__ = ["palimpsa_attention", "gla_attention", "gated_delta_attention", "PALIMPSA_BACKENDS",
           "GLA_BACKENDS", "GATED_DELTA_BACKENDS"]
