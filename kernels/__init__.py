"""Palimpsa compute core (`palimpsa_jax.kernels`), independent of Flax.

`palimpsa_attention` (metaplastic), `gla_attention` (non-metaplastic Mamba2 / simple GLA) and
`gated_delta_attention` (Gated DeltaNet) dispatch to backends: a sequential reference
(`*_reference` in naive.py), a chunked pure-JAX path (`*_chunked` in chunk.py) and Pallas
kernels (`palimpsa_pallas_gpu`, `palimpsa_pallas_tpu`, `gla_pallas_gpu`,
`gated_delta_pallas_gpu`). Each returns `o`
alone, or an `AttentionOutput` (o, final_state, variance) when an extra is asked for.
`kernels.rules` holds the sequential update rules of the unified Bayesian view (Mamba2,
DeltaNet, Gated DeltaNet, Longhorn, Mesa, Palimpsa).
"""
from palimpsa_jax.kernels.api import (
                                      GATED_DELTA_BACKENDS,
                                      GLA_BACKENDS,
                                      PALIMPSA_BACKENDS,
                                      gated_delta_attention,
                                      gla_attention,
                                      palimpsa_attention,
)
from palimpsa_jax.kernels.outputs import AttentionOutput, Posterior

__all__ = ["palimpsa_attention", "gla_attention", "gated_delta_attention", "AttentionOutput",
           "Posterior", "PALIMPSA_BACKENDS", "GLA_BACKENDS", "GATED_DELTA_BACKENDS"]
