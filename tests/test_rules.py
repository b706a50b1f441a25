"""Properties of the sequential reference rules of kernels/rules.py (README "The unified view"), in float64."""
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax.config.update("jax_enable_x64", True)

from palimpsa_jax.kernels import rules  # noqa: E402  (after enabling x64)

TOL = dict(rtol=1e-10, atol=1e-12)
lengths, key_dims, value_dims = st.integers(1, 12), st.integers(1, 6), st.integers(1, 6)
seeds = st.integers(0, 2**32 - 1)


def hypothesis_settings(max_examples):
    return settings(max_examples=max_examples, deadline=None, database=None)


# Independent NumPy loops, written from the table of README "The unified view". A state is (S, P) with P the
# precision (None for the rules without one); each update maps (S, P, k, v, beta, alpha, prior).

def np_mamba2(S, P, k, v, b, a, p):
    return a * S + np.outer(b * v / p, k), P


def np_deltanet(S, P, k, v, b, a, p):
    return S @ (np.eye(len(k)) - b * np.outer(k, k)) + b * np.outer(v, k), P


def np_gated_deltanet(S, P, k, v, b, a, p):
    return a * S @ (np.eye(len(k)) - b * np.outer(k, k)) + b * np.outer(v, k), P


def np_longhorn(S, P, k, v, b, a, p):
    denominator = 1 + b * (k @ k)
    return ((1 - np.outer(b, k**2) / denominator[:, None]) * S
            + np.outer(b * v / denominator, k)), P


def np_mesa(S, P, k, v, b, a, p):
    P_new = a * P + (1 - a) * p * np.eye(len(k)) + b * np.outer(k, k)
    return (a * S @ P + b * np.outer(v, k)) @ np.linalg.inv(P_new), P_new


def np_palimpsa(S, I, k, v, b, a, p):
    I_new = a * I + (1 - a) * p + np.outer(b, k**2)
    return (a * I * S + np.outer(b * v, k)) / I_new, I_new


NP_RULES = {"mamba2": np_mamba2, "deltanet": np_deltanet, "gated_deltanet": np_gated_deltanet,
            "longhorn": np_longhorn, "mesa": np_mesa, "palimpsa": np_palimpsa}


def np_run(name, q, k, v, beta, log_alpha, prior):
    dk, dv = q.shape[1], v.shape[1]
    S = np.zeros((dv, dk))
    P = {"mesa": prior * np.eye(dk), "palimpsa": np.full((dv, dk), prior)}.get(name)
    outputs = []
    for t in range(len(q)):
        S, P = NP_RULES[name](S, P, k[t], v[t], beta[t], np.exp(log_alpha[t]), prior)
        outputs.append(dk**-0.5 * S @ q[t])
    return np.array(outputs), S, P


def sequence(seed, length, dk, dv, vector_beta=True):
    """Random float64 inputs of one head: unit keys, beta in (0.1, 1), alpha in (0.5, 1)."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(length, dk))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    return dict(q=rng.normal(size=(length, dk)), k=k, v=rng.normal(size=(length, dv)),
                beta=rng.uniform(0.1, 1.0, size=(length, dv) if vector_beta else length),
                log_alpha=np.log(rng.uniform(0.5, 1.0, size=length)),
                prior=rng.uniform(0.5, 2.0))


def scaled_one_hot(rng, index, dk):
    """Keys (T, Dk) with one non-zero entry per row, at `index` (T,), of random sign and size."""
    k = np.zeros((len(index), dk))
    size = rng.choice([-1, 1], len(index)) * rng.uniform(0.5, 2, len(index))
    k[np.arange(len(index)), index] = size
    return k


@pytest.mark.parametrize("name", sorted(rules.RULES))
@hypothesis_settings(12)
@given(length=lengths, dk=key_dims, dv=value_dims, seed=seeds)
def test_rule_matches_numpy_loop(name, length, dk, dv, seed):
    rule = rules.RULES[name]
    x = sequence(seed, length, dk, dv, rule.vector_beta)
    outputs, state = rules.run(rule, **x)
    expected, S, P = np_run(name, **x)
    assert outputs.dtype == np.float64 and outputs.shape == (length, dv)
    np.testing.assert_allclose(outputs, expected, **TOL)
    np.testing.assert_allclose(rules.memory(state), S, **TOL)
    if P is not None:
        np.testing.assert_allclose(state.importance, P, **TOL)


@pytest.mark.parametrize("name", sorted(rules.RULES))
@hypothesis_settings(4)
@given(length=st.integers(2, 12), dk=key_dims, dv=value_dims, seed=seeds, data=st.data())
def test_resuming_from_a_state_continues_the_sequence(name, length, dk, dv, seed, data):
    rule = rules.RULES[name]
    x = sequence(seed, length, dk, dv, rule.vector_beta)
    split = data.draw(st.integers(1, length - 1), label="split")
    head = {n: a[:split] if np.ndim(a) else a for n, a in x.items()}
    tail = {n: a[split:] if np.ndim(a) else a for n, a in x.items()}
    expected, expected_state = rules.run(rule, **x)
    first, state = rules.run(rule, **head)
    second, state = rules.run(rule, **tail, state=state)
    np.testing.assert_allclose(np.concatenate([first, second]), expected, **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), state, expected_state)


@hypothesis_settings(10)
@given(length=lengths, dk=key_dims, dv=value_dims, seed=seeds)
def test_mesa_equals_palimpsa_for_one_hot_keys(length, dk, dv, seed):
    """k kᵀ is diagonal, so Mesa's precision P stays diagonal and equals every row of Palimpsa's
    importance when beta is constant across Dv."""
    rng = np.random.default_rng([seed, 1])
    x = sequence(seed, length, dk, dv, vector_beta=False)
    x["k"] = scaled_one_hot(rng, rng.integers(dk, size=length), dk)
    mesa_out, mesa = rules.run(rules.MESA, **x)
    x["beta"] = np.repeat(x["beta"][:, None], dv, axis=1)
    palimpsa_out, palimpsa = rules.run(rules.PALIMPSA, **x)
    np.testing.assert_allclose(palimpsa_out, mesa_out, **TOL)
    np.testing.assert_allclose(palimpsa.mu, mesa.mu, **TOL)
    rows = np.broadcast_to(np.diag(mesa.importance), palimpsa.importance.shape)
    np.testing.assert_allclose(palimpsa.importance, rows, **TOL)


@hypothesis_settings(10)
@given(length=lengths, dk=key_dims, dv=value_dims, seed=seeds)
def test_gated_deltanet_without_forgetting_is_deltanet(length, dk, dv, seed):
    x = sequence(seed, length, dk, dv, vector_beta=False)
    x["log_alpha"] = np.zeros(length)
    np.testing.assert_allclose(rules.run(rules.GATED_DELTANET, **x)[0],
                               rules.run(rules.DELTANET, **x)[0], **TOL)


@hypothesis_settings(10)
@given(length=lengths, dk=key_dims, dv=value_dims, seed=seeds)
def test_palimpsa_is_a_ratio_of_two_mamba2_memories(length, dk, dv, seed):
    """Natural-parameter form (README "The kernel API"): M = I ⊙ mu and Ibar = I - I_prior are both Mamba2
    memories (I_prior = 1), M of (k, v) and Ibar of (k², 1), from M_0 = mu_0 ⊙ I_0 and
    Ibar_0 = I_0 - I_prior."""
    rng = np.random.default_rng([seed, 1])
    x = sequence(seed, length, dk, dv)
    mu0, importance0 = rng.normal(size=(dv, dk)), rng.uniform(0.1, 3.0, size=(dv, dk))
    _, (mu, importance) = rules.run(rules.PALIMPSA, **x, state=(mu0, importance0))
    mamba2 = dict(x, prior=1.0)
    _, M = rules.run(rules.MAMBA2, **mamba2, state=mu0 * importance0)
    _, Ibar = rules.run(rules.MAMBA2, **dict(mamba2, k=x["k"] ** 2, v=np.ones((length, dv))),
                        state=importance0 - x["prior"])
    np.testing.assert_allclose(importance, Ibar + x["prior"], **TOL)
    np.testing.assert_allclose(mu, M / (Ibar + x["prior"]), **TOL)


@hypothesis_settings(10)
@given(length=lengths, dk=key_dims, dv=value_dims, seed=seeds)
def test_prior_times_palimpsa_tends_to_mamba2(length, dk, dv, seed):
    """prior * o_palimpsa = scale (M / (1 + Ibar / prior)) q: the error to Mamba2 (I_prior = 1)
    falls like 1 / prior."""
    x = sequence(seed, length, dk, dv)
    mamba2, _ = rules.run(rules.MAMBA2, **dict(x, prior=1.0))
    priors = np.array([1e2, 1e4, 1e6])
    errors = np.array([np.abs(prior * rules.run(rules.PALIMPSA, **dict(x, prior=prior))[0]
                              - mamba2).max() for prior in priors])
    assert np.all(np.diff(errors) <= 0)
    np.testing.assert_allclose(errors * priors, errors[-1] * priors[-1], rtol=0.3, atol=1e-8)


@hypothesis_settings(10)
@given(dk=key_dims, dv=value_dims, seed=seeds, data=st.data())
def test_longhorn_is_palimpsa_from_unit_importance_on_fresh_keys(dk, dv, seed, data):
    """Without forgetting, a Palimpsa step from importance 1 divides by 1 + beta ⊗ k², Longhorn's
    by 1 + beta kᵀk: equal when k has one non-zero entry. Palimpsa's importance then grows on that
    entry while Longhorn restarts from 1, so the rules agree while each key entry is hit at most
    once (T <= Dk, distinct one-hot directions), from any memory S_0 and for any prior."""
    rng = np.random.default_rng([seed, 1])
    length = data.draw(st.integers(1, dk), label="length")
    x = sequence(seed, length, dk, dv)
    x["k"] = scaled_one_hot(rng, rng.permutation(dk)[:length], dk)
    x["log_alpha"] = np.zeros(length)
    S0 = rng.normal(size=(dv, dk))
    longhorn_out, S = rules.run(rules.LONGHORN, **x, state=S0)
    palimpsa_out, palimpsa = rules.run(rules.PALIMPSA, **x, state=(S0, np.ones_like(S0)))
    np.testing.assert_allclose(palimpsa_out, longhorn_out, **TOL)
    np.testing.assert_allclose(palimpsa.mu, S, **TOL)


@pytest.mark.parametrize("name", sorted(rules.RULES))
def test_float32_inputs_stay_float32(name):
    rule = rules.RULES[name]
    x = {n: np.asarray(a, np.float32) for n, a in sequence(0, 5, 3, 2, rule.vector_beta).items()}
    outputs, state = rules.run(rule, **dict(x, prior=1.5))
    assert outputs.dtype == np.float32
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize("name", sorted(rules.RULES))
def test_beta_shape_follows_the_rule(name):
    rule = rules.RULES[name]
    x = sequence(0, 4, 3, 2, vector_beta=not rule.vector_beta)
    with pytest.raises(ValueError, match="beta"):
        rules.run(rule, **x)
