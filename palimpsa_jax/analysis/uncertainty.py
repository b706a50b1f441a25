"""Does the predictive variance mean something? Per scored token, the memory's predictive
variance next to whether the model's prediction is right (MQAR) or its loss (text)."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import optax

from palimpsa_jax.analysis import measures

IGNORE = -100


class ScoredTokens(NamedTuple):
    """One entry per scored token (label != -100): variance (N,) the mean predictive variance
    of the layer's outputs at that token (over heads and value rows); correct (N,) bool, the
    argmax prediction equals the label; loss (N,) the cross-entropy."""
    variance: np.ndarray
    correct: np.ndarray
    loss: np.ndarray


def scored_tokens(logits, labels, variance) -> ScoredTokens:
    """logits (B, T, V), labels (B, T), variance (B, T, H, Dv) of one layer -> ScoredTokens."""
    logits, labels = np.asarray(logits, np.float32), np.asarray(labels)
    scored = labels != IGNORE
    safe = np.where(scored, labels, 0)
    loss = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits), jnp.asarray(safe)))
    mean_variance = np.asarray(jnp.mean(variance, axis=(-2, -1)))
    return ScoredTokens(mean_variance[scored], (logits.argmax(-1) == safe)[scored], loss[scored])


class Calibration(NamedTuple):
    """auroc: AUROC of the variance as a detector of errors (0.5: no information, 1: every
    error has a higher variance than every correct prediction); spearman: rank correlation of
    variance and loss; edges (K + 1,), accuracy (K,), mean_loss (K,), count (K,): the tokens
    in K equal-count buckets of ascending variance."""
    auroc: float
    spearman: float
    edges: np.ndarray
    accuracy: np.ndarray
    mean_loss: np.ndarray
    count: np.ndarray


def calibration(tokens: ScoredTokens, buckets: int = 5) -> Calibration:
    edges, accuracy, count = measures.by_quantile_bucket(tokens.variance, tokens.correct, buckets)
    _, mean_loss, _ = measures.by_quantile_bucket(tokens.variance, tokens.loss, buckets)
    ranks = lambda x: np.argsort(np.argsort(x, kind="mergesort"), kind="mergesort")
    spearman = (float(np.corrcoef(ranks(tokens.variance), ranks(tokens.loss))[0, 1])
                if len(tokens.loss) > 1 else float("nan"))
    return Calibration(measures.auroc(tokens.variance, ~tokens.correct), spearman, edges,
                       accuracy, mean_loss, count)

