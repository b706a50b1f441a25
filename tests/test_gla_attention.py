"""kernels.gla_attention: every backend against independent float64 references."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import backends
from palimpsa_jax import kernels
from palimpsa_jax.kernels.gla import pallas_gpu
from palimpsa_jax.kernels.gla.pallas_gpu import gla_pallas_gpu
from references import gla_jax64, gla_numpy, random_inputs, relative_error

BACKENDS = sorted(kernels.GLA_BACKENDS)
shapes = st.tuples(st.integers(1, 2), st.integers(1, 40), st.integers(1, 3), st.integers(1, 6),
                   st.integers(1, 6))


call = functools.partial(backends.call, kernels.gla_attention)


VALUES = dict(shape=shapes, chunk_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16),
              with_state=st.booleans(), with_segments=st.booleans(),
              dtype=st.sampled_from([np.float32, jnp.bfloat16]))


def check_values(backend, x64, shape, chunk_size, seed, with_state, with_segments, dtype):
    B, T, H, Dk, Dv = shape
    q, k, v, _, log_alpha, _, segment_ids = random_inputs(seed, B, T, H, Dk, Dv, dtype)
    S0 = np.random.default_rng(seed).normal(size=(B, H, Dv, Dk)).astype(np.float32) if with_state else None
    segment_ids = segment_ids if with_segments else None
    o, S, _ = call(backend, q, k, v, log_alpha, chunk_size=chunk_size, initial_state=S0,
                   segment_ids=segment_ids, return_final_state=True, x64=x64)
    o_ref, S_ref = gla_numpy(q, k, v, log_alpha, Dk**-0.5, S0, segment_ids)
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
    q, k, v, _, log_alpha, _, segment_ids = random_inputs(seed, B, T, H, Dk, Dv)
    segment_ids = segment_ids if with_segments else None
    rng = np.random.default_rng(seed + 1)
    S0 = rng.normal(size=(B, H, Dv, Dk)).astype(np.float32)
    w_o, w_S = rng.normal(size=(B, T, H, Dv)), rng.normal(size=(B, H, Dv, Dk))

    def grad(kernel):
        def loss(*args):
            o, S = kernel(*args)[:2]
            return jnp.sum(w_o * o) + jnp.sum(w_S * S)
        return jax.grad(loss, argnums=tuple(range(5)))

    args = (q, k, v, log_alpha, S0)
    with backends.x64_mode(x64):
        grads = jax.jit(grad(lambda *a: call(
            backend, *a[:4], chunk_size=chunk_size, initial_state=a[4], segment_ids=segment_ids,
            return_final_state=True, jit=False)))(*args)
    grads_ref = grad(lambda *a: gla_jax64(*a, scale=Dk**-0.5, segment_ids=segment_ids))(
        *(jnp.asarray(x, jnp.float64) for x in args))
    for name, g, g_ref in zip(["q", "k", "v", "log_alpha", "initial_state"], grads, grads_ref):
        assert relative_error(g, g_ref) < 2e-5, name


test_gradients_match_float64_autodiff, test_gradients_match_float64_autodiff_without_x64 = backends.in_both_x64_modes(
    check_gradients, GRADIENTS, BACKENDS, (4, 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_halves_equal_whole(backend):
    q, k, v, _, log_alpha, _, _ = random_inputs(1, 2, 50, 2, 4, 3)
    o, S, _ = call(backend, q, k, v, log_alpha, chunk_size=16, return_final_state=True)
    o1, S1, _ = call(backend, q[:, :21], k[:, :21], v[:, :21], log_alpha[:, :21], chunk_size=16,
                  return_final_state=True)
    o2, S2, _ = call(backend, q[:, 21:], k[:, 21:], v[:, 21:], log_alpha[:, 21:], chunk_size=16,
                  initial_state=S1, return_final_state=True)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(S2, S, rtol=2e-5, atol=2e-6)


def test_pallas_gpu_state_tiles(monkeypatch):
    """pallas_gpu's two sequential kernels split the (Dv, Dk) state into block x block tiles, one
    program each: several tiles over both axes (and T not a multiple of the chunk) give the
    float64 reference's values, final state and gradients."""
    B, T, H, Dk, Dv = 2, 45, 2, 20, 40            # padded to 32 x 64: 2 x 4 tiles of 16
    monkeypatch.setitem(kernels.GLA_BACKENDS, "pallas_gpu",
                        functools.partial(gla_pallas_gpu, block=16))
    q, k, v, _, log_alpha, _, segment_ids = random_inputs(5, B, T, H, Dk, Dv)
    S0 = np.random.default_rng(6).normal(size=(B, H, Dv, Dk)).astype(np.float32)
    backends.assert_gradients_match(
        lambda *a: kernels.gla_attention(
            *a[:4], initial_state=a[4], segment_ids=segment_ids, return_final_state=True,
            backend="pallas_gpu", chunk_size=16, **backends.options("pallas_gpu")),
        lambda *a: gla_jax64(*a, scale=Dk**-0.5, segment_ids=segment_ids),
        (q, k, v, log_alpha, S0), ["q", "k", "v", "log_alpha", "initial_state"])


def test_pallas_gpu_backward_kernels_take_backward_num_warps():
    """The forward's kernels compile with num_warps, the backward's (its recomputation of the
    states included) with backward_num_warps."""
    q, k, v, _, log_alpha, _, _ = random_inputs(0, 1, 32, 1, 4, 4)
    reset = np.zeros(log_alpha.shape, bool)
    o = lambda q, k, v: gla_pallas_gpu(q, k, v, log_alpha, np.zeros((1, 1, 4, 4), np.float32),
                                       reset, scale=0.5, chunk_size=16, interpret=True,
                                       num_warps=2, backward_num_warps=8)[0]
    assert [kernel[:2] for kernel in backends.pallas_kernels(o, q, k, v)] == [
        ("gla_states", 2), ("gla_output", 2),
        ("gla_states", 8), ("gla_state_cotangents", 8), ("gla_gradients", 8)]


def test_pallas_gpu_forward_stores_chunk_states_in_the_compute_dtype():
    """16-bit inputs: the forward's states kernel stores each chunk's entering state in bf16,
    which the output kernel multiplies in bf16 anyway, so the output equals the one from float32
    states bit for bit; the backward's recomputed states stay float32."""
    q, k, v, _, log_alpha, _, _ = random_inputs(1, 2, 48, 2, 8, 12, jnp.bfloat16)
    reset = np.zeros(log_alpha.shape, bool)
    S0 = np.zeros((2, 2, 12, 8), np.float32)
    o = lambda q, k, v: gla_pallas_gpu(q, k, v, log_alpha, S0, reset, scale=0.5, chunk_size=16,
                                       interpret=True)[0]
    states = [kernel.out_dtypes[0] for kernel in backends.pallas_kernels(o, q, k, v)
              if kernel.name == "gla_states"]
    assert states == [jnp.bfloat16, jnp.float32]
    config = pallas_gpu.make_config(16, 0.5, 16, 4, 2, True)
    (q, k, v), g, seg = pallas_gpu.chunk_inputs((q, k, v), log_alpha, reset, 16)
    S0 = pallas_gpu.pad_state(S0, 16, 16)
    outputs = [pallas_gpu.output(q, k, v, g, seg, pallas_gpu._scan(
        k, v, g, seg, S0, config, reverse=False, states_dtype=dtype)[0], config)
        for dtype in (jnp.bfloat16, jnp.float32)]
    assert outputs[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(outputs[0], np.float32), np.asarray(outputs[1], np.float32))


@pytest.mark.parametrize("option,value", [("block", 24), ("block", 8), ("chunk_size", 0),
                                          ("num_warps", 3), ("backward_num_warps", 0)])
def test_pallas_gpu_bad_options_raise_value_error_naming_them(option, value):
    q, k, v, _, log_alpha, _, _ = random_inputs(0, 1, 8, 1, 4, 4)
    reset = np.zeros(log_alpha.shape, bool)
    with pytest.raises(ValueError, match=f"^{option} "):
        gla_pallas_gpu(q, k, v, log_alpha, np.zeros((1, 1, 4, 4), np.float32), reset, scale=0.5,
                       interpret=True, **{option: value})


@pytest.mark.parametrize("argument,changes", [
    ("q", dict(q=np.ones((2, 3)))),
    ("v", dict(v=np.ones((1, 5, 2, 3), np.float32))),
    ("v", dict(v=np.ones((2, 5, 2, 3), np.float64))),
    ("log_alpha", dict(log_alpha=np.ones((2, 5, 2), np.float32))),
    ("initial_state", dict(initial_state=np.ones((2, 2, 4, 3), np.float32))),
    ("segment_ids", dict(segment_ids=np.zeros((2, 4), np.int32))),
    ("backend", dict(backend="pallas_cpu")),
])
def test_bad_arguments_raise_value_error_naming_them(argument, changes):
    rng = np.random.default_rng(0)
    kwargs = dict(q=rng.normal(size=(2, 5, 2, 4)).astype(np.float32),
                  k=rng.normal(size=(2, 5, 2, 4)).astype(np.float32),
                  v=rng.normal(size=(2, 5, 2, 3)).astype(np.float32),
                  log_alpha=-np.ones((2, 5, 2), np.float32))
    kwargs.update(changes)
    positional = [kwargs.pop(n) for n in ["q", "k", "v", "log_alpha"]]
    with pytest.raises(ValueError, match=f"^{argument} "):
        kernels.gla_attention(*positional, **kwargs)
