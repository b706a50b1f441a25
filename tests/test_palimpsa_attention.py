"""kernels.palimpsa_attention: every backend against independent float64 references, jitted,
with JAX's 64-bit mode on and off."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import backends
from palimpsa_jax import kernels
from palimpsa_jax.kernels import validation
from palimpsa_jax.kernels.palimpsa import pallas_gpu
from references import gla_numpy, palimpsa_jax64, palimpsa_numpy, random_inputs, relative_error

BACKENDS = sorted(kernels.PALIMPSA_BACKENDS)
CHUNKED = [b for b in BACKENDS if b != "reference"]
call = functools.partial(backends.call, kernels.palimpsa_attention)
PRIOR_FAMILIES = ("head", "row", "synapse")


def prior_of_family(family, prior, Dv, Dk, seed):
    """A positive prior of shape (H,), (H, Dv) or (H, Dv, Dk) around the per-head `prior`."""
    extra = {"head": (), "row": (Dv,), "synapse": (Dv, Dk)}[family]
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.3, 3.0, size=(len(prior), *extra)).astype(np.float32)
    return (prior.reshape(prior.shape + (1,) * len(extra)) * scale).astype(np.float32)


def random_state(seed, B, H, Dv, Dk):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(B, H, Dv, Dk)).astype(np.float32)
    importance = rng.uniform(0.2, 5.0, size=(B, H, Dv, Dk)).astype(np.float32)
    return mu, importance


shapes = st.tuples(st.integers(1, 2), st.integers(1, 40), st.integers(1, 3), st.integers(1, 6),
                   st.integers(1, 6))


VALUES = dict(shape=shapes, chunk_size=st.sampled_from([1, 4, 8, 16]), seed=st.integers(0, 2**16),
              with_state=st.booleans(), with_segments=st.booleans(),
              dtype=st.sampled_from([np.float32, jnp.bfloat16]),
              family=st.sampled_from(PRIOR_FAMILIES))


def check_values(backend, x64, shape, chunk_size, seed, with_state, with_segments, dtype, family):
    B, T, H, Dk, Dv = shape
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(seed, B, T, H, Dk, Dv, dtype)
    prior = prior_of_family(family, prior, Dv, Dk, seed)
    state = random_state(seed, B, H, Dv, Dk) if with_state else None
    segment_ids = segment_ids if with_segments else None
    o, (mu, importance), var = call(backend, q, k, v, beta, log_alpha, prior, chunk_size=chunk_size,
                                    initial_state=state, segment_ids=segment_ids,
                                    return_final_state=True, return_variance=True, x64=x64)
    o_ref, (mu_ref, I_ref), var_ref = palimpsa_numpy(q, k, v, beta, log_alpha, prior, Dk**-0.5,
                                                     state, segment_ids)
    assert o.dtype == v.dtype and o.shape == (B, T, H, Dv)
    assert mu.dtype == importance.dtype == var.dtype == jnp.float32
    # Accumulation is float32 whatever the inputs; a bf16 output is only rounded once.
    assert relative_error(o, o_ref) < (1e-5 if dtype == np.float32 else 8e-3)
    for actual, expected in [(mu, mu_ref), (importance, I_ref), (var, var_ref)]:
        assert relative_error(actual, expected) < 1e-5




test_matches_float64_numpy, test_matches_float64_numpy_without_x64 = backends.in_both_x64_modes(
    check_values, VALUES, BACKENDS, (10, 3))


GRADIENTS = dict(shape=shapes, chunk_size=st.sampled_from([1, 4, 8]), seed=st.integers(0, 2**16),
                 with_segments=st.booleans(), family=st.sampled_from(PRIOR_FAMILIES))


def check_gradients(backend, x64, shape, chunk_size, seed, with_segments, family):
    B, T, H, Dk, Dv = shape
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(seed, B, T, H, Dk, Dv)
    prior = prior_of_family(family, prior, Dv, Dk, seed)
    segment_ids = segment_ids if with_segments else None
    mu0, I0 = random_state(seed + 1, B, H, Dv, Dk)
    rng = np.random.default_rng(seed + 2)
    w_o, w_var = rng.normal(size=(2, B, T, H, Dv))
    w_mu, w_I = rng.normal(size=(2, B, H, Dv, Dk))

    def loss(kernel):
        def f(q, k, v, beta, log_alpha, prior, mu0, I0):
            o, (mu, importance), var = kernel(q, k, v, beta, log_alpha, prior, mu0, I0)
            return (jnp.sum(w_o * o) + jnp.sum(w_var * var) + jnp.sum(w_mu * mu)
                    + jnp.sum(w_I * importance))
        return jax.grad(f, argnums=tuple(range(8)))

    args = (q, k, v, beta, log_alpha, prior, mu0, I0)
    with backends.x64_mode(x64):
        grads = jax.jit(loss(lambda *a: call(
            backend, *a[:6], chunk_size=chunk_size, initial_state=a[6:], segment_ids=segment_ids,
            return_final_state=True, return_variance=True, jit=False)))(*args)
    grads_ref = loss(lambda *a: palimpsa_jax64(*a, scale=Dk**-0.5, segment_ids=segment_ids))(
        *(jnp.asarray(x, jnp.float64) for x in args))
    names = ["q", "k", "v", "beta", "log_alpha", "prior", "mu0", "I0"]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.dtype == jnp.asarray(args[names.index(name)]).dtype, name
        assert relative_error(g, g_ref) < 2e-5, name


test_gradients_match_float64_autodiff, test_gradients_match_float64_autodiff_without_x64 = backends.in_both_x64_modes(
    check_gradients, GRADIENTS, BACKENDS, (5, 2))


def test_float64_references_agree():
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(0, 2, 23, 2, 4, 3)
    mu0, I0 = random_state(1, 2, 2, 3, 4)
    expected = palimpsa_numpy(q, k, v, beta, log_alpha, prior, 0.7, (mu0, I0), segment_ids)
    actual = palimpsa_jax64(q, k, v, beta, log_alpha, prior, jnp.asarray(mu0, jnp.float64),
                            jnp.asarray(I0, jnp.float64), 0.7, segment_ids)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert relative_error(a, e) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [1, 13, 32, 47])
def test_two_halves_equal_whole(backend, split):
    q, k, v, beta, log_alpha, prior, _ = random_inputs(3, 2, 48, 2, 5, 4)
    run = lambda sl, state: call(backend, q[:, sl], k[:, sl], v[:, sl], beta[:, sl],
                                 log_alpha[:, sl], prior, chunk_size=8, initial_state=state,
                                 return_final_state=True)[:2]
    o, state = run(slice(None), None)
    o1, state1 = run(slice(None, split), None)
    o2, state2 = run(slice(split, None), state1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o, rtol=2e-5, atol=2e-6)
    for a, b in zip(state2, state):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_segments_equal_separate_runs(backend):
    lengths = [5, 17, 1, 9]
    q, k, v, beta, log_alpha, prior, _ = random_inputs(4, 1, sum(lengths), 2, 3, 4)
    segment_ids = np.repeat(np.arange(len(lengths)), lengths)[None]
    state = random_state(5, 1, 2, 4, 3)
    o, final, _ = call(backend, q, k, v, beta, log_alpha, prior, chunk_size=8,
                       initial_state=state, segment_ids=segment_ids, return_final_state=True)
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        o_i, final_i, _ = call(backend, q[:, sl], k[:, sl], v[:, sl], beta[:, sl],
                               log_alpha[:, sl], prior, chunk_size=8,
                               initial_state=state if i == 0 else None, return_final_state=True)
        np.testing.assert_allclose(o[:, sl], o_i, rtol=2e-5, atol=2e-6)
        start += n
    for a, b in zip(final, final_i):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_precision_is_gla_over_prior(backend):
    """beta = 0 keeps I = prior exactly, so the read-out is the GLA output divided by the prior."""
    q, k, v, _, log_alpha, prior, segment_ids = random_inputs(6, 2, 30, 3, 4, 5)
    o = call(backend, q, k, v, np.zeros_like(v), log_alpha, prior, segment_ids=segment_ids)
    o_gla, _ = gla_numpy(q, k, v, log_alpha, 4**-0.5, segment_ids=segment_ids)
    assert relative_error(o, o_gla / prior[:, None]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_prior_tends_to_gla(backend):
    """Mamba2 is the forgetting-dominated limit: prior * o -> o_GLA with error O(1 / prior)."""
    q, k, v, beta, log_alpha, _, _ = random_inputs(7, 1, 40, 2, 4, 3)
    o_gla, _ = gla_numpy(q, k, v, log_alpha, 0.5)
    errors = []
    for prior in [1e1, 1e2, 1e3, 1e4]:
        o = call(backend, q, k, v, beta, log_alpha, np.full(2, prior, np.float32))
        errors.append(relative_error(prior * np.asarray(o, np.float64), o_gla))
    assert errors[-1] < 1e-3
    ratios = np.array(errors[:-1]) / np.array(errors[1:])
    assert np.all((ratios > 5) & (ratios < 20)), errors


PALLAS_GPU_SETTINGS = {
    "recurrent-fwd1-bwd1": (dict(design="recurrent", time_splits=1, backward_time_splits=1), 1),
    "recurrent-fwd2-bwd8": (dict(design="recurrent", time_splits=2, backward_time_splits=8), 1),
    "recurrent-fwd16-bwd4": (dict(design="recurrent", time_splits=16, backward_time_splits=4), 1),
    "parallel-3-row-tiles": (dict(design="parallel", block_v=2, backward_block_v=2), 1),
    "parallel-bfloat16": (dict(design="parallel", precision="bfloat16"), 1000),
}


@pytest.mark.parametrize("setting", sorted(PALLAS_GPU_SETTINGS))
def test_pallas_gpu_designs_compute_the_same_function(monkeypatch, setting):
    """pallas_gpu's two designs: the recurrent one with any time splits (run in parallel in both
    passes: the forward from each split's entering state, the backward from each split's entering
    cotangent) and the chunk-parallel one with any row tiles give the float64 reference's outputs,
    final state, variance and every gradient; its bfloat16 products within about 2^-9 of them."""
    options, tolerance_factor = PALLAS_GPU_SETTINGS[setting]
    B, T, H, Dk, Dv, C = 1, 62, 2, 3, 5, 4                          # 16 chunks, the last padded
    monkeypatch.setitem(kernels.PALIMPSA_BACKENDS, "pallas_gpu", functools.partial(
        pallas_gpu.palimpsa_pallas_gpu, **options))
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(13, B, T, H, Dk, Dv)
    state = random_state(14, B, H, Dv, Dk)
    rng = np.random.default_rng(15)
    w_o, w_var = rng.normal(size=(2, B, T, H, Dv))
    w_mu, w_I = rng.normal(size=(2, B, H, Dv, Dk))

    def loss(kernel):
        def f(*args):
            o, (mu, importance), var = kernel(*args)
            return (jnp.sum(w_o * o) + jnp.sum(w_var * var) + jnp.sum(w_mu * mu)
                    + jnp.sum(w_I * importance))
        return jax.value_and_grad(f, argnums=tuple(range(8)))

    args = (q, k, v, beta, log_alpha, prior, *state)
    value, grads = loss(lambda *a: call("pallas_gpu", *a[:6], chunk_size=C, initial_state=a[6:],
                                        segment_ids=segment_ids, return_final_state=True,
                                        return_variance=True, jit=False))(*args)
    with backends.x64_mode(True):
        ref_value, ref_grads = loss(lambda *a: palimpsa_jax64(
            *a, scale=Dk**-0.5, segment_ids=segment_ids))(*(jnp.asarray(x, jnp.float64) for x in args))
    assert relative_error(value, ref_value) < 1e-5 * tolerance_factor
    errors = {name: relative_error(g, g_ref) for name, g, g_ref in zip(
        ["q", "k", "v", "beta", "log_alpha", "prior", "mu0", "I0"], grads, ref_grads)}
    assert max(errors.values()) < 2e-5 * tolerance_factor, errors
    if tolerance_factor > 1:    # the rounding is really there
        assert max(errors.values()) > 2e-5, errors


@pytest.mark.parametrize("options, message", [
    (dict(design="sequential"), "^design must be one of"),
    (dict(design="parallel", time_splits=2), "^time_splits and backward_time_splits are options"),
    (dict(design="recurrent", precision="bfloat16"), "^precision is an option of the 'parallel'"),
    (dict(design="parallel", precision="float16"), "^precision must be one of"),
    (dict(design="recurrent", chunk_size=6), "^chunk_size must be a power of two"),
])
def test_pallas_gpu_bad_options_raise_value_error(options, message):
    q, k, v, beta, log_alpha, prior, _ = random_inputs(16, 1, 16, 1, 2, 2)
    zeros = np.zeros((1, 1, 2, 2), np.float32)
    with pytest.raises(ValueError, match=message):
        jax.grad(lambda *a: pallas_gpu.palimpsa_pallas_gpu(
            *a, zeros, zeros, np.zeros(log_alpha.shape, bool), scale=0.5, return_variance=False,
            interpret=True, **options)[0].sum())(q, k, v, beta, log_alpha, np.ones((1, 2, 2), np.float32))


@pytest.mark.parametrize("design", pallas_gpu.DESIGNS)
def test_pallas_gpu_kernels_take_the_approximate_reciprocal_on_a_gpu(monkeypatch, design):
    """Lowered for a GPU (here, on the CPU), every Palimpsa kernel of the forward and the backward
    computes 1 / I with the one-instruction reciprocal `rcp.approx.ftz.f32`
    (`pallas_gpu_parallel.reciprocal`); in interpret mode, where the tests above check the values,
    the division is exact."""
    monkeypatch.setattr(validation, "check_platform", lambda *args: None)
    q, k, v, beta, log_alpha, prior, _ = random_inputs(17, 1, 32, 1, 16, 16)
    zeros = np.zeros((1, 1, 16, 16), np.float32)
    loss = lambda *a: pallas_gpu.palimpsa_pallas_gpu(
        *a, zeros, zeros, np.zeros(log_alpha.shape, bool), scale=0.25, return_variance=True,
        design=design)[1].sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
        q, k, v, beta, log_alpha, np.ones((1, 16, 16), np.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    launches = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*", text)
    names = {re.search(r'name = "(\w+)"', launch).group(1) for launch in launches}
    assert {"forward", "backward"} <= {"forward" if "forward" in name else "backward"
                                       for name in names}, names
    assert all("rcp.approx.ftz.f32" in launch for launch in launches), names


@pytest.mark.parametrize("option", ["time_splits", "backward_time_splits"])
def test_pallas_gpu_time_splits_must_divide_the_chunks(option):
    q, k, v, beta, log_alpha, prior, _ = random_inputs(16, 1, 40, 1, 2, 2)   # 5 chunks of 8
    zeros = np.zeros((1, 1, 2, 2), np.float32)
    run = lambda *a: pallas_gpu.palimpsa_pallas_gpu(
        *a, zeros, zeros, np.zeros(log_alpha.shape, bool), scale=0.5, return_variance=False,
        chunk_size=8, interpret=True, design="recurrent", **{option: 2})[0].sum()
    with pytest.raises(ValueError, match=f"^{option} must divide the number of chunks 5"):
        jax.grad(run)(q, k, v, beta, log_alpha, np.ones((1, 2, 2), np.float32))


EXTREMES = {
    "no_forgetting": dict(log_alpha=0.0),
    "total_forgetting": dict(log_alpha=-1e4),
    "zero_precision": dict(beta=0.0),
    "huge_precision": dict(beta=1e4),
    "tiny_prior": dict(prior=1e-4),
    "huge_prior": dict(prior=1e4),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(EXTREMES))
def test_extreme_gates_stay_finite_and_accurate(backend, case):
    q, k, v, beta, log_alpha, prior, _ = random_inputs(8, 1, 33, 2, 3, 2)
    inputs = dict(beta=beta, log_alpha=log_alpha, prior=prior)
    for name, value in EXTREMES[case].items():
        inputs[name] = np.full_like(inputs[name], value)
    o, (mu, importance), var = call(backend, q, k, v, inputs["beta"], inputs["log_alpha"],
                                    inputs["prior"], chunk_size=8, return_final_state=True,
                                    return_variance=True)
    expected = palimpsa_numpy(q, k, v, inputs["beta"], inputs["log_alpha"], inputs["prior"], 3**-0.5)
    for actual, ref in zip([o, mu, importance, var], jax.tree.leaves(expected)):
        assert np.all(np.isfinite(actual))
        assert relative_error(actual, ref) < 1e-4
    grads = jax.grad(lambda *a: jnp.sum(call(backend, *a, chunk_size=8)),
                     argnums=tuple(range(6)))(
        q, k, v, inputs["beta"], inputs["log_alpha"], inputs["prior"])
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [1, 16384])
def test_sequence_length_extremes(backend, length):
    q, k, v, beta, log_alpha, prior, _ = random_inputs(9, 1, length, 1, 2, 2)
    o, state, _ = call(backend, q, k, v, beta, log_alpha, prior, return_final_state=True)
    o_ref, state_ref, _ = palimpsa_numpy(q, k, v, beta, log_alpha, prior, 2**-0.5)
    assert relative_error(o, o_ref) < 1e-5
    assert all(relative_error(a, b) < 1e-5 for a, b in zip(state, state_ref))


@pytest.mark.parametrize("backend", CHUNKED)
def test_saved_residuals_are_chunk_boundary_states(backend):
    """The backward keeps the inputs and one state per chunk: O(B·H·(T/C)·Dv·Dk), not O(T·Dv·Dk)."""
    B, T, H, Dk, Dv, C = 1, 256, 1, 16, 16, 32
    q, k, v, beta, log_alpha, prior, _ = random_inputs(10, B, T, H, Dk, Dv)
    args = (q, k, v, beta, log_alpha, prior)
    saved = lambda backend, **kw: sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(
            jax.vjp(lambda *a: call(backend, *a, jit=False, **kw), *args)[1]))
    inputs = sum(np.asarray(x).nbytes for x in args)
    boundary_states = 2 * (T // C + 1) * B * H * Dv * Dk * 4
    assert saved(backend, chunk_size=C) <= 2 * inputs + boundary_states
    # The sequential reference keeps every state, which the bound above must exclude.
    assert saved("reference") > 2 * inputs + boundary_states


def _bad_arguments():
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(11, 2, 6, 2, 3, 4)
    good = dict(q=q, k=k, v=v, beta=beta, log_alpha=log_alpha, prior=prior)
    state = random_state(0, 2, 2, 4, 3)
    return good, [
        ("q", dict(q=q[..., 0])),
        ("k", dict(k=k[:, :5])),
        ("v", dict(v=v[:, :, :1])),
        ("beta", dict(beta=beta[..., :3])),
        ("log_alpha", dict(log_alpha=log_alpha[..., None])),
        ("prior", dict(prior=prior[:1])),
        ("prior", dict(prior=np.ones((2, 3), np.float32))),     # (H, Dk): not a prior family
        ("k", dict(k=k.astype(jnp.bfloat16))),
        ("beta", dict(beta=beta.astype(np.float16))),
        ("q", dict(q=q.astype(np.int32), k=k.astype(np.int32), v=v.astype(np.int32),
                   beta=beta.astype(np.int32))),
        ("prior", dict(prior=np.array([1.0, 0.0], np.float32))),
        ("prior", dict(prior=np.array([1.0, -2.0], np.float32))),
        ("log_alpha", dict(log_alpha=np.abs(log_alpha) + 0.1)),
        ("beta", dict(beta=-beta)),
        ("segment_ids", dict(segment_ids=segment_ids[:, :3])),
        ("segment_ids", dict(segment_ids=segment_ids.astype(np.float32))),
        ("initial_state", dict(initial_state=state[0])),
        ("initial_state[I]", dict(initial_state=(state[0], state[1][..., :2]))),
        ("initial_state[I]", dict(initial_state=(state[0], -state[1]))),
        ("scale", dict(scale=-1.0)),
        ("q", dict(q=np.where(np.arange(3) == 1, np.nan, q))),
        ("k", dict(k=np.where(np.arange(3) == 2, np.inf, k))),
        ("v", dict(v=np.where(np.arange(4) == 0, -np.inf, v))),
        ("beta", dict(beta=np.where(np.arange(4) == 3, np.nan, beta))),
        ("log_alpha", dict(log_alpha=np.where(np.arange(2) == 1, np.nan, log_alpha))),
        ("prior", dict(prior=np.array([1.0, np.inf], np.float32))),
        ("initial_state[mu]", dict(initial_state=(np.full_like(state[0], np.nan), state[1]))),
        ("backend", dict(backend="cuda")),
        ("chunk_size", dict(backend="reference", chunk_size=8)),
        ("chunk_size", dict(backend="xla", chunk_size=0)),
    ]


@pytest.mark.parametrize("argument,changes", _bad_arguments()[1],
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(_bad_arguments()[1])])
def test_bad_arguments_raise_value_error_naming_them(argument, changes):
    good = _bad_arguments()[0]
    kwargs = {**good, **changes}
    positional = [kwargs.pop(n) for n in ["q", "k", "v", "beta", "log_alpha", "prior"]]
    with pytest.raises(ValueError, match=f"^{re.escape(argument)} "):
        kernels.palimpsa_attention(*positional, **kwargs)


@pytest.mark.parametrize("changes", [
    dict(prior=-np.ones(1, np.float32)),
    dict(log_alpha=np.ones((1, 4, 1), np.float32)),
    dict(beta=-np.ones((1, 4, 1, 2), np.float32)),
    dict(q=np.full((1, 4, 1, 2), np.nan, np.float32)),
], ids=["negative prior", "positive log_alpha", "negative beta", "NaN q"])
def test_values_are_not_checked_under_jit(changes):
    """Eagerly each of these bad values is a ValueError; under jit only shapes are checked
    (documented): the call runs and returns an array of the right shape."""
    q, k, v, beta, log_alpha, prior, _ = random_inputs(12, 1, 4, 1, 2, 2)
    args = {**dict(q=q, k=k, v=v, beta=beta, log_alpha=log_alpha, prior=prior), **changes}
    with pytest.raises(ValueError, match=f"^{next(iter(changes))} "):
        kernels.palimpsa_attention(**args)
    assert jax.jit(kernels.palimpsa_attention)(**args).shape == (1, 4, 1, 2)
    with pytest.raises(ValueError, match="^prior must have shape"):
        jax.jit(kernels.palimpsa_attention)(**{**args, "prior": prior[None]})
