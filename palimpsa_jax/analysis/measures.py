"""Prior against posterior, measured: functions of a Bayesian memory's state (mu, I), its prior
and its gates, each returning arrays per head (the first axes are the caller's: batch, heads).

The posterior of a synapse is N(mu, 1/I) and its prior N(0, 1/I_prior): importance above the
prior is consolidated evidence, low importance is plasticity.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def broadcast_prior(prior, shape):
    """A prior (H,), (H, Dv) or (H, Dv, Dk) broadcast to a state of `shape` (..., H, Dv, Dk)."""
    prior = jnp.asarray(prior)
    return jnp.broadcast_to(prior.reshape(prior.shape + (1,) * (3 - prior.ndim)), shape)


def importance_ratio(importance, prior):
    """I / I_prior, element-wise: (..., H, Dv, Dk)."""
    return importance / broadcast_prior(prior, importance.shape)


def ratio_quantiles(importance, prior, quantiles=QUANTILES):
    """Quantiles of I / I_prior over the batch and the Dv x Dk synapses of each head:
    (len(quantiles), H). importance: (B, H, Dv, Dk)."""
    ratio = importance_ratio(importance, prior)
    per_head = jnp.moveaxis(ratio, -3, 0).reshape(ratio.shape[-3], -1)
    return jnp.quantile(per_head, jnp.asarray(quantiles), axis=1)


def ratio_histogram(importance, prior, bins):
    """Counts of log10(I / I_prior) per head in the given bin edges: (H, len(bins) - 1)."""
    ratio = np.asarray(importance_ratio(importance, prior))
    per_head = np.moveaxis(ratio, -3, 0).reshape(ratio.shape[-3], -1)
    return np.stack([np.histogram(np.log10(h), bins=bins)[0] for h in per_head])


def kl_to_prior(mu, importance, prior):
    """KL( N(mu, 1/I) || N(0, 1/I_prior) ) summed over each head's synapses, in nats: (B, H).

    Per synapse, with P = I_prior: 0.5 (P / I + P mu² - 1 + ln(I / P)).
    """
    P = broadcast_prior(prior, importance.shape)
    per_synapse = 0.5 * (P / importance + P * mu * mu - 1.0 + jnp.log(importance / P))
    return jnp.sum(per_synapse, axis=(-2, -1))


def consolidated_fraction(importance, prior, factor: float = 2.0):
    """Fraction of each head's synapses whose importance exceeds factor x prior: (B, H)."""
    return jnp.mean(importance_ratio(importance, prior) > factor, axis=(-2, -1))


def metaplasticity_ratio(importance, prior, low: float = 0.1, high: float = 0.9):
    """The spread between plastic and consolidated synapses of each head: the `high` quantile
    of I / I_prior over its `low` quantile, over the batch and the synapses: (H,)."""
    q = ratio_quantiles(importance, prior, (low, high))
    return q[1] / q[0]


def memory_window(log_alpha):
    """N = 1 / (1 - alpha) per token, alpha = exp(log_alpha): the effective window."""
    return -1.0 / jnp.expm1(jnp.asarray(log_alpha, jnp.float32))


def window_quantiles(log_alpha, quantiles=QUANTILES):
    """Quantiles of the memory window over the batch's tokens, per head: (len(quantiles), H);
    log_alpha (B, T, H). The median, not the mean, which a few near-1 gates dominate."""
    window = memory_window(log_alpha)
    return jnp.quantile(window.reshape(-1, window.shape[-1]), jnp.asarray(quantiles), axis=0)


def auroc(scores, positives) -> float:
    """Area under the ROC curve of `scores` for the boolean `positives` (the probability that a
    positive scores higher than a negative, ties counting half); nan without both classes."""
    scores, positives = np.asarray(scores, np.float64).ravel(), np.asarray(positives, bool).ravel()
    num_pos, num_neg = positives.sum(), (~positives).sum()
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    starts = np.concatenate([[0], np.flatnonzero(np.diff(sorted_scores)) + 1])
    ends = np.concatenate([starts[1:], [len(scores)]])
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    return float((ranks[positives].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def by_quantile_bucket(values, outcomes, buckets: int = 5):
    """Mean of `outcomes` in `buckets` equal-count buckets of `values` (ascending): returns the
    bucket edges (buckets + 1,), the mean outcome and the count of each bucket."""
    values, outcomes = np.asarray(values, np.float64).ravel(), np.asarray(outcomes, np.float64).ravel()
    edges = np.quantile(values, np.linspace(0, 1, buckets + 1))
    index = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, buckets - 1)
    means = np.array([outcomes[index == b].mean() if np.any(index == b) else np.nan
                      for b in range(buckets)])
    counts = np.bincount(index, minlength=buckets)
    return edges, means, counts
