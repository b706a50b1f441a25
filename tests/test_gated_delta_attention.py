"""kernels.gated_delta_attention: every backend against independent float64 references."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import backends
from palimpsa_jax import kernels
from palimpsa_jax.kernels import rules
from palimpsa_jax.kernels.gated_deltanet import pallas_gpu
from palimpsa_jax.kernels.gated_deltanet.pallas_gpu import gated_delta_pallas_gpu
from palimpsa_jax.kernels.gla import pallas_gpu as gla
from references import gated_delta_jax64, gated_delta_numpy, relative_error

BACKENDS = sorted(kernels.GATED_DELTA_BACKENDS)
shapes = st.tuples(st.integers(1, 2), st.integers(1, 40), st.integers(1, 3), st.integers(1, 6),
                   st.integers(1, 6))


def random_inputs(seed, B, T, H, Dk, Dv, dtype=np.float32):
    """q, k L2-normalised per head and v (B, T, H, D) in dtype; beta in (0, 1) in dtype;
    log_alpha (B, T, H) in [-1, 0] float32; segment_ids (B, T) with a few boundaries."""
    rng = np.random.default_rng(seed)
    cast = lambda x: np.asarray(jnp.asarray(x, dtype))
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = cast(unit(rng.normal(size=(B, T, H, Dk))))
    k = cast(unit(rng.normal(size=(B, T, H, Dk))))
    v = cast(rng.normal(size=(B, T, H, Dv)))
    beta = cast(1 / (1 + np.exp(-2 * rng.normal(size=(B, T, H)))))
    log_alpha = -rng.uniform(0.0, 1.0, size=(B, T, H)).astype(np.float32) ** 3
    segment_ids = np.cumsum(rng.uniform(size=(B, T)) < 0.1, axis=1).astype(np.int32)
    return q, k, v, beta, log_alpha, segment_ids


call = functools.partial(backends.call, kernels.gated_delta_attention)


VALUES = dict(shape=shapes, chunk_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16),
              with_state=st.booleans(), with_segments=st.booleans(),
              dtype=st.sampled_from([np.float32, jnp.bfloat16]))


def check_values(backend, x64, shape, chunk_size, seed, with_state, with_segments, dtype):
    B, T, H, Dk, Dv = shape
    q, k, v, beta, log_alpha, segment_ids = random_inputs(seed, B, T, H, Dk, Dv, dtype)
    S0 = np.random.default_rng(seed).normal(size=(B, H, Dv, Dk)).astype(np.float32) if with_state else None
    segment_ids = segment_ids if with_segments else None
    o, S, _ = call(backend, q, k, v, beta, log_alpha, chunk_size=chunk_size, initial_state=S0,
                   segment_ids=segment_ids, return_final_state=True, x64=x64)
    o_ref, S_ref = gated_delta_numpy(q, k, v, beta, log_alpha, Dk**-0.5, S0, segment_ids)
    assert o.dtype == v.dtype and S.dtype == jnp.float32
    # 16-bit inputs: the chunked backend's matrix multiplies run in 16 bits (float32 sums)
    tolerance = 1e-5 if dtype == np.float32 else 8e-3
    assert relative_error(o, o_ref) < tolerance and relative_error(S, S_ref) < tolerance


test_matches_float64_numpy, test_matches_float64_numpy_without_x64 = backends.in_both_x64_modes(
    check_values, VALUES, BACKENDS, (8, 3))


GRADIENTS = dict(shape=shapes, chunk_size=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2**16),
                 with_segments=st.booleans())


def check_gradients(backend, x64, shape, chunk_size, seed, with_segments):
    B, T, H, Dk, Dv = shape
    q, k, v, beta, log_alpha, segment_ids = random_inputs(seed, B, T, H, Dk, Dv)
    segment_ids = segment_ids if with_segments else None
    rng = np.random.default_rng(seed + 1)
    S0 = rng.normal(size=(B, H, Dv, Dk)).astype(np.float32)
    w_o, w_S = rng.normal(size=(B, T, H, Dv)), rng.normal(size=(B, H, Dv, Dk))

    def grad(kernel):
        def loss(*args):
            o, S = kernel(*args)[:2]
            return jnp.sum(w_o * o) + jnp.sum(w_S * S)
        return jax.grad(loss, argnums=tuple(range(6)))

    args = (q, k, v, beta, log_alpha, S0)
    with backends.x64_mode(x64):
        grads = jax.jit(grad(lambda *a: call(
            backend, *a[:5], chunk_size=chunk_size, initial_state=a[5], segment_ids=segment_ids,
            return_final_state=True, jit=False)))(*args)
    with jax.enable_x64(True):
        grads_ref = grad(lambda *a: gated_delta_jax64(*a, scale=Dk**-0.5, segment_ids=segment_ids))(
            *(jnp.asarray(x, jnp.float64) for x in args))
        grads_ref = [np.asarray(g) for g in grads_ref]
    for name, g, g_ref in zip(["q", "k", "v", "beta", "log_alpha", "initial_state"], grads, grads_ref):
        assert relative_error(g, g_ref) < 2e-5, name


test_gradients_match_float64_autodiff, test_gradients_match_float64_autodiff_without_x64 = backends.in_both_x64_modes(
    check_gradients, GRADIENTS, BACKENDS, (4, 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_halves_equal_whole(backend):
    q, k, v, beta, log_alpha, _ = random_inputs(1, 2, 50, 2, 4, 3)
    halves = lambda x: (x[:, :21], x[:, 21:])
    o, S, _ = call(backend, q, k, v, beta, log_alpha, chunk_size=16, return_final_state=True)
    first, second = zip(*map(halves, (q, k, v, beta, log_alpha)))
    o1, S1, _ = call(backend, *first, chunk_size=16, return_final_state=True)
    o2, S2, _ = call(backend, *second, chunk_size=16, initial_state=S1, return_final_state=True)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(S2, S, rtol=2e-5, atol=2e-6)


def run_rule(rule, q, k, v, beta, log_alpha, S0):
    """kernels.rules.run on every (b, h) in float64; returns o (B, T, H, Dv) and S."""
    B, _, H, _ = q.shape
    o, S = np.zeros(v.shape), np.zeros(S0.shape)
    with jax.enable_x64(True):
        for b in range(B):
            for h in range(H):
                args = (x[b, :, h].astype(np.float64) for x in (q, k, v, beta, log_alpha))
                o_bh, S_bh = rules.run(rule, *args, np.float64(1.0), state=S0[b, h].astype(np.float64))
                o[b, :, h], S[b, h] = o_bh, S_bh
    return o, S


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_forgetting_is_deltanet(backend):
    q, k, v, beta, _, _ = random_inputs(2, 2, 37, 2, 5, 3)
    S0 = np.random.default_rng(2).normal(size=(2, 2, 3, 5)).astype(np.float32)
    log_alpha = np.zeros(beta.shape, np.float32)
    o, S, _ = call(backend, q, k, v, beta, log_alpha, chunk_size=16, initial_state=S0,
                return_final_state=True)
    o_ref, S_ref = run_rule(rules.DELTANET, q, k, v, beta, log_alpha, S0)
    assert relative_error(o, o_ref) < 1e-5 and relative_error(S, S_ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_unified_gated_deltanet_rule(backend):
    q, k, v, beta, log_alpha, _ = random_inputs(3, 1, 45, 1, 6, 4)
    S0 = np.random.default_rng(3).normal(size=(1, 1, 4, 6)).astype(np.float32)
    o, S, _ = call(backend, q, k, v, beta, log_alpha, chunk_size=8, initial_state=S0,
                return_final_state=True)
    o_ref, S_ref = run_rule(rules.GATED_DELTANET, q, k, v, beta, log_alpha, S0)
    assert relative_error(o, o_ref) < 1e-5 and relative_error(S, S_ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_stable_for_very_negative_log_alpha(backend):
    q, k, v, beta, log_alpha, _ = random_inputs(4, 1, 20, 2, 4, 3)
    every_third = np.arange(20)[None, :, None] % 3 == 0
    log_alpha = np.broadcast_to(np.where(every_third, -1e4, -80.0), beta.shape).astype(np.float32)
    loss = lambda la: jnp.sum(call(backend, q, k, v, beta, la, chunk_size=8) ** 2)
    o = call(backend, q, k, v, beta, log_alpha, chunk_size=8)
    o_ref, _ = gated_delta_numpy(q, k, v, beta, log_alpha, 0.5)
    assert relative_error(o, o_ref) < 1e-5
    assert np.all(np.isfinite(jax.grad(loss)(log_alpha)))


def test_pallas_gpu_tiles_and_doublings(monkeypatch):
    """pallas_gpu walks the value and key axes in block-wide tiles (the scans, the local
    cotangents and both gradient kernels) and inverts Id + A in log2(C) doublings: several tiles
    over both axes, C = 32 (five doublings) and T not a multiple of C give the float64
    reference's values, final state and gradients."""
    B, T, H, Dk, Dv = 2, 45, 2, 20, 40            # padded to 32 x 64: 2 x 4 tiles of 16
    monkeypatch.setitem(kernels.GATED_DELTA_BACKENDS, "pallas_gpu",
                        functools.partial(gated_delta_pallas_gpu, block=16))
    q, k, v, beta, log_alpha, segment_ids = random_inputs(5, B, T, H, Dk, Dv)
    S0 = np.random.default_rng(6).normal(size=(B, H, Dv, Dk)).astype(np.float32)
    backends.assert_gradients_match(
        lambda *a: kernels.gated_delta_attention(
            *a[:5], initial_state=a[5], segment_ids=segment_ids, return_final_state=True,
            backend="pallas_gpu", chunk_size=32, **backends.options("pallas_gpu")),
        lambda *a: gated_delta_jax64(*a, scale=Dk**-0.5, segment_ids=segment_ids),
        (q, k, v, beta, log_alpha, S0), ["q", "k", "v", "beta", "log_alpha", "initial_state"])


def test_pallas_gpu_backward_kernels_take_backward_num_warps():
    """The forward's kernels compile with num_warps, the backward's (its recomputation of
    prepare and the states included) with backward_num_warps."""
    q, k, v, beta, log_alpha, _ = random_inputs(0, 1, 32, 1, 4, 4)
    reset = np.zeros(log_alpha.shape, bool)
    o = lambda q, k, v, beta: gated_delta_pallas_gpu(
        q, k, v, beta, log_alpha, np.zeros((1, 1, 4, 4), np.float32), reset, scale=0.5,
        chunk_size=16, interpret=True, num_warps=2, backward_num_warps=8)[0]
    forward = ["gated_delta_prepare", "gated_delta_states", "gla_output"]
    backward = forward[:2] + ["gated_delta_local_cotangents", "gated_delta_state_cotangents",
                              "gated_delta_state_gradients", "gated_delta_wy_gradients"]
    assert [kernel[:2] for kernel in backends.pallas_kernels(o, q, k, v, beta)] == (
        [(name, 2) for name in forward] + [(name, 8) for name in backward])


def test_pallas_gpu_forward_stores_chunk_states_in_the_compute_dtype():
    """16-bit inputs: the forward's states kernel stores each chunk's entering state in bf16,
    which the output kernel multiplies in bf16 anyway, so the output equals the one from the
    backward's float32 states bit for bit."""
    q, k, v, beta, log_alpha, _ = random_inputs(1, 2, 48, 2, 8, 12, jnp.bfloat16)
    reset = np.zeros(log_alpha.shape, bool)
    S0 = np.zeros((2, 2, 12, 8), np.float32)
    o = lambda q, k, v, beta: gated_delta_pallas_gpu(q, k, v, beta, log_alpha, S0, reset,
                                                     scale=0.5, chunk_size=16, interpret=True)[0]
    states = [kernel.out_dtypes[0] for kernel in backends.pallas_kernels(o, q, k, v, beta)
              if kernel.name == "gated_delta_states"]
    assert states == [jnp.bfloat16, jnp.float32]
    config = gla.make_config(16, 0.5, 16, 4, 2, True)
    (q, k, v, beta), g, seg = gla.chunk_inputs((q, k, v, beta), log_alpha, reset, 16)
    beta, S0 = jnp.moveaxis(beta, 1, 2), gla.pad_state(S0, 16, 16)
    outputs = []
    for backward in (False, True):
        _, _, S_in, U, _ = pallas_gpu._states(k, v, beta, g, seg, S0, config, backward=backward)
        outputs.append(np.asarray(gla.output(q, k, U, g, seg, S_in, config), np.float32))
    np.testing.assert_array_equal(*outputs)


@pytest.mark.parametrize("option,value", [("block", 24), ("block", 8), ("chunk_size", 0),
                                          ("num_warps", 3), ("backward_num_warps", 0)])
def test_pallas_gpu_bad_options_raise_value_error_naming_them(option, value):
    q, k, v, beta, log_alpha, _ = random_inputs(0, 1, 8, 1, 4, 4)
    reset = np.zeros(log_alpha.shape, bool)
    with pytest.raises(ValueError, match=f"^{option} "):
        gated_delta_pallas_gpu(q, k, v, beta, log_alpha, np.zeros((1, 1, 4, 4), np.float32),
                               reset, scale=0.5, interpret=True, **{option: value})


@pytest.mark.parametrize("argument,changes", [
    ("q", dict(q=np.ones((2, 3)))),
    ("k", dict(k=np.ones((2, 5, 2, 3), np.float32))),
    ("v", dict(v=np.ones((1, 5, 2, 3), np.float32))),
    ("v", dict(v=np.ones((2, 5, 2, 3), np.float64))),
    ("beta", dict(beta=np.ones((2, 5, 2, 3), np.float32))),
    ("beta", dict(beta=np.ones((2, 5, 2), np.int32))),
    ("beta", dict(beta=-np.ones((2, 5, 2), np.float32))),
    ("log_alpha", dict(log_alpha=np.ones((2, 5, 2), np.float32))),
    ("initial_state", dict(initial_state=np.ones((2, 2, 4, 3), np.float32))),
    ("segment_ids", dict(segment_ids=np.zeros((2, 4), np.int32))),
    ("scale", dict(scale=-1.0)),
    ("backend", dict(backend="pallas_gpu")),
    ("chunk_size", dict(backend="reference", chunk_size=4)),
    ("chunk_size", dict(backend="xla", chunk_size=0)),
])
def test_bad_arguments_raise_value_error_naming_them(argument, changes):
    rng = np.random.default_rng(0)
    kwargs = dict(q=rng.normal(size=(2, 5, 2, 4)).astype(np.float32),
                  k=rng.normal(size=(2, 5, 2, 4)).astype(np.float32),
                  v=rng.normal(size=(2, 5, 2, 3)).astype(np.float32),
                  beta=np.full((2, 5, 2), 0.5, np.float32),
                  log_alpha=-np.ones((2, 5, 2), np.float32))
    kwargs.update(changes)
    positional = [kwargs.pop(n) for n in ["q", "k", "v", "beta", "log_alpha"]]
    with pytest.raises(ValueError, match=f"^{argument} "):
        kernels.gated_delta_attention(*positional, **kwargs)
