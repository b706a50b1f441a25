"""The unified framework as code: sequential reference update rules (README "The unified view").

Every rule keeps the memory S (Dv, Dk) of one head, updates it once per token and reads out
o_t = scale * S_t @ q_t; Mesa and Palimpsa keep a Gaussian posterior and read out its mean mu.
A rule is a `Rule` with

    rule.init(dk, dv, prior) -> state               (state before the first token)
    rule.step(state, obs)    -> (state, S_t @ obs.q)

for a single token `obs` (an `Observation`), and `run` scans a whole sequence with it. `RULES`
maps names to rules. These are float64-friendly references for tests and notebooks, not kernels.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg

from palimpsa_jax.kernels.outputs import Posterior

Array = jax.Array


class Observation(NamedTuple):
    """One token of one head.

    q, k: (Dk,) query and key (`run` passes q already multiplied by scale).
    v: (Dv,) raw value. beta: input precision, () for the scalar-beta rules (DeltaNet, Gated
    DeltaNet, Mesa) and (Dv,) for the vector-beta rules (Mamba2, Longhorn, Palimpsa).
    log_alpha: () <= 0, forget gate alpha = exp(log_alpha). prior: () > 0, prior precision I_prior.
    """
    q: Array
    k: Array
    v: Array
    beta: Array
    log_alpha: Array
    prior: Array


State = Array | Posterior


def memory(state: State) -> Array:
    """The memory S_t (Dv, Dk) a state reads out: the posterior mean mu for Mesa and Palimpsa."""
    return state.mu if isinstance(state, Posterior) else state


def _zero_memory(dk: int, dv: int, prior) -> Array:
    return jnp.zeros((dv, dk), jnp.result_type(prior))


def _diagonal_prior(dk: int, dv: int, prior) -> Posterior:
    return Posterior(_zero_memory(dk, dv, prior), jnp.full((dv, dk), prior))


def _full_prior(dk: int, dv: int, prior) -> Posterior:
    return Posterior(_zero_memory(dk, dv, prior), prior * jnp.eye(dk, dtype=jnp.result_type(prior)))


def _forget(precision: Array, alpha: Array, prior_precision) -> Array:
    """Discards a fraction 1 - alpha of the evidence, relaxing the precision toward the prior."""
    return alpha * precision + (1 - alpha) * prior_precision


def _mamba2(S: Array, x: Observation) -> Array:
    """S_t = alpha S + (beta ⊙ v / I_prior) ⊗ k."""
    return jnp.exp(x.log_alpha) * S + jnp.outer(x.beta * x.v / x.prior, x.k)


def _gated_deltanet(S: Array, x: Observation) -> Array:
    """S_t = alpha S (Id - beta k kᵀ) + beta v kᵀ = alpha S + beta (v - alpha S k) kᵀ."""
    alpha = jnp.exp(x.log_alpha)
    return alpha * S + x.beta * jnp.outer(x.v - alpha * S @ x.k, x.k)


def _deltanet(S: Array, x: Observation) -> Array:
    """S_t = S (Id - beta k kᵀ) + beta v kᵀ: Gated DeltaNet without forgetting (alpha = 1)."""
    return _gated_deltanet(S, x._replace(log_alpha=jnp.zeros_like(x.log_alpha)))


def _longhorn(S: Array, x: Observation) -> Array:
    """S_t = (1 - eps ⊗ k²) ⊙ S + (eps ⊙ v) ⊗ k, eps = beta / (1 + beta kᵀk) row-wise.
    No forgetting and no prior: log_alpha and prior are ignored."""
    eps = x.beta / (1 + x.beta * (x.k @ x.k))
    return S - jnp.outer(eps, x.k**2) * S + jnp.outer(eps * x.v, x.k)


def _mesa(post: Posterior, x: Observation) -> Posterior:
    """P_t = alpha P + (1 - alpha) I_prior Id + beta k kᵀ;
    mu_t = (alpha mu P + beta v kᵀ) P_t⁻¹."""
    alpha = jnp.exp(x.log_alpha)
    prior_precision = x.prior * jnp.eye(x.k.shape[0], dtype=x.k.dtype)
    precision = _forget(post.importance, alpha, prior_precision) + x.beta * jnp.outer(x.k, x.k)
    evidence = alpha * post.mu @ post.importance + x.beta * jnp.outer(x.v, x.k)
    cholesky = jax.scipy.linalg.cho_factor(precision)  # P_t is symmetric positive definite
    return Posterior(jax.scipy.linalg.cho_solve(cholesky, evidence.T).T, precision)


def _palimpsa(post: Posterior, x: Observation) -> Posterior:
    """I_t = alpha I + (1 - alpha) I_prior + beta ⊗ k²;
    mu_t = (alpha I ⊙ mu + (beta ⊙ v) ⊗ k) / I_t."""
    alpha = jnp.exp(x.log_alpha)
    importance = _forget(post.importance, alpha, x.prior) + jnp.outer(x.beta, x.k**2)
    evidence = alpha * post.importance * post.mu + jnp.outer(x.beta * x.v, x.k)
    return Posterior(evidence / importance, importance)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sequential update rule of one head.

    update(state, obs) -> state applies one token; init(dk, dv, prior) -> state is the state
    before the first token (S = 0; for Mesa and Palimpsa mu = 0 and precision = prior), in the
    dtype of `prior`. vector_beta: whether beta is (Dv,) per token (else a scalar).
    """
    name: str
    update: Callable[[State, Observation], State]
    vector_beta: bool
    init: Callable[[int, int, Array], State] = _zero_memory

    def step(self, state: State, obs: Observation) -> tuple[State, Array]:
        """Applies one token; returns the new state and S_t @ obs.q, shape (Dv,)."""
        state = self.update(state, obs)
        return state, memory(state) @ obs.q


MAMBA2 = Rule("mamba2", _mamba2, vector_beta=True)
DELTANET = Rule("deltanet", _deltanet, vector_beta=False)
GATED_DELTANET = Rule("gated_deltanet", _gated_deltanet, vector_beta=False)
LONGHORN = Rule("longhorn", _longhorn, vector_beta=True)
MESA = Rule("mesa", _mesa, vector_beta=False, init=_full_prior)
PALIMPSA = Rule("palimpsa", _palimpsa, vector_beta=True, init=_diagonal_prior)

RULES: dict[str, Rule] = {rule.name: rule for rule in
                          (MAMBA2, DELTANET, GATED_DELTANET, LONGHORN, MESA, PALIMPSA)}


@functools.partial(jax.jit, static_argnames="rule")
def run(rule: Rule, q, k, v, beta, log_alpha, prior, *, scale=None,
        state: State | None = None) -> tuple[Array, State]:
    """Runs `rule` over one head's sequence with jax.lax.scan.

    q, k: (T, Dk); v: (T, Dv); beta: (T, Dv) if rule.vector_beta else (T,); log_alpha: (T,);
    prior: scalar. scale defaults to Dk ** -0.5; state defaults to rule.init(Dk, Dv, prior).
    Computes in the promoted floating dtype of the inputs (float64 under jax_enable_x64).
    Returns the outputs o_t = scale * S_t @ q_t, shape (T, Dv), and the final state.
    """
    length, dk = jnp.shape(q)
    dv = jnp.shape(v)[-1]
    expected = (length, dv) if rule.vector_beta else (length,)
    if jnp.shape(beta) != expected:
        raise ValueError(f"beta must have shape {expected} for rule {rule.name!r}, "
                         f"got {jnp.shape(beta)}")
    dtype = jnp.result_type(float, q, k, v, beta, log_alpha, prior)
    q, k, v, beta, log_alpha, prior = (jnp.asarray(x, dtype)
                                       for x in (q, k, v, beta, log_alpha, prior))
    scale = dk**-0.5 if scale is None else scale
    initial = rule.init(dk, dv, prior)
    if state is not None:  # any pytree with the leaves of rule.init's state, e.g. a (mu, I) pair
        initial = jax.tree.unflatten(jax.tree.structure(initial),
                                     [jnp.asarray(s, dtype) for s in jax.tree.leaves(state)])

    def step(state, token):
        return rule.step(state, Observation(*token, prior))

    state, outputs = jax.lax.scan(step, initial, (scale * q, k, v, beta, log_alpha))
    return outputs, state
