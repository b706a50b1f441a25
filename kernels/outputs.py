"""What the kernels return: one structure for all three entry points."""
from __future__ import annotations

from typing import NamedTuple

import jax

Array = jax.Array


class Posterior(NamedTuple):
    """A Gaussian memory: mean `mu` and precision `importance`.

    From `palimpsa_attention`: both (B, H, Dv, Dk) float32, the diagonal importance I of every
    synapse. In `kernels.rules` (one head): mu (Dv, Dk) and importance (Dv, Dk) for Palimpsa,
    the full precision (Dk, Dk) shared by every row for Mesa.
    """
    mu: Array
    importance: Array


class AttentionOutput(NamedTuple):
    """The result of a kernel call that asked for an extra (`return_final_state` or
    `return_variance`); what was not asked for is None.

    o: (B, T, H, Dv) in v's dtype.
    final_state: the state after the last token, float32: a `Posterior` (mu, I) for
      `palimpsa_attention`, the memory S (B, H, Dv, Dk) for `gla_attention` and
      `gated_delta_attention`.
    variance: (B, T, H, Dv) float32, the predictive variance (`palimpsa_attention` only).
    """
    o: Array
    final_state: Posterior | Array | None = None
    variance: Array | None = None
