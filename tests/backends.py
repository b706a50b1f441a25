"""Calling a kernel backend the way the tests do: compiled with `jax.jit`, Pallas backends in
interpret mode on CPU, with JAX's 64-bit mode on (the test default) or off."""
import contextlib
import functools
from typing import NamedTuple

import jax
import numpy as np
import pytest
from hypothesis import given, settings

from references import relative_error

# The kernel tests run every backend under jax.jit with jax_enable_x64 on and off.
X64_MODES = pytest.mark.parametrize("x64", [True, False], ids=["x64", "x32"])

STATIC = ("scale", "return_final_state", "return_variance")


def options(backend: str, chunk_size=None) -> dict:
    """Backend options: chunk_size for the chunked backends, interpret=True for Pallas on CPU."""
    opts = {} if chunk_size is None or backend == "reference" else {"chunk_size": chunk_size}
    if backend.startswith("pallas") and jax.default_backend() == "cpu":
        opts["interpret"] = True
    return opts


def call(kernel, backend: str, *args, chunk_size=None, jit: bool = True, x64: bool = True,
         **kwargs):
    """kernel(*args, backend=backend, **kwargs), jitted (arrays traced, flags static) under the
    given 64-bit mode. The jitted function is cached per (kernel, backend, options, flags, mode),
    so calls with the same shapes compile once."""
    static = tuple(sorted((name, kwargs.pop(name)) for name in STATIC if name in kwargs))
    run = _runner(kernel, backend, chunk_size, static, x64) if jit else functools.partial(
        _run, functools.partial(kernel, backend=backend, **options(backend, chunk_size),
                                **dict(static)))
    with x64_mode(x64):
        return run(args, kwargs)


def _run(bound, args, kwargs):
    return bound(*args, **kwargs)


@functools.cache
def _runner(kernel, backend, chunk_size, static, x64):
    bound = functools.partial(kernel, backend=backend, **options(backend, chunk_size),
                              **dict(static))
    return jax.jit(functools.partial(_run, bound))


def x64_mode(x64: bool):
    """A context with jax_enable_x64 as given (the tests run with it on by default)."""
    return contextlib.nullcontext() if x64 else jax.enable_x64(False)


def in_both_x64_modes(check, strategies: dict, backends, examples: tuple[int, int]):
    """Two hypothesis tests of `check(backend, x64, **case)` over every backend, under jit: x64
    on (examples[0] cases per backend) and off (examples[1]); assign them to test_* names."""
    def make(x64, count):
        @pytest.mark.parametrize("backend", backends)
        @settings(max_examples=count)
        @given(**strategies)
        def test(backend, **case):
            check(backend, x64, **case)
        return test
    return make(True, examples[0]), make(False, examples[1])


def assert_gradients_match(ours, reference, args, names, seed: int = 0):
    """<w_o, o> + <w_S, S_T> of kernels returning (o, S_T, ...), with random weights, and its
    gradients w.r.t. all `args` (named `names`): `ours` (jitted) against `reference` in float64,
    relative errors below 1e-5 (the value) and 2e-5 (each gradient)."""
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=x.shape) for x in jax.eval_shape(ours, *args)[:2]]

    def grad(kernel):
        def loss(*a):
            return sum(jax.numpy.sum(w * x) for w, x in zip(weights, kernel(*a)[:2]))
        return jax.value_and_grad(loss, argnums=tuple(range(len(args))))

    with x64_mode(True):
        value_ref, grads_ref = grad(reference)(*(jax.numpy.asarray(x, "float64") for x in args))
    value, grads = jax.jit(grad(ours))(*args)
    assert relative_error(value, value_ref) < 1e-5
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert relative_error(g, g_ref) < 2e-5, name


class Kernel(NamedTuple):
    name: str
    num_warps: int
    out_dtypes: tuple


def pallas_kernels(fn, *args) -> list[Kernel]:
    """(kernel name, num_warps, dtypes of its outputs) of every pallas_call in the jaxpr of
    jax.value_and_grad(fn) over all its arguments, in program order (the forward's kernels
    first)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                params = eqn.params["compiler_params"]
                params = params if hasattr(params, "num_warps") else params["triton"]
                name = eqn.params.get("name") or eqn.params["name_and_src_info"]
                found.append(Kernel(str(name).split()[0], params.num_warps,
                                    tuple(out.aval.dtype for out in eqn.outvars)))
            for value in eqn.params.values():
                for inner in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(inner, "jaxpr", inner)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    grad = jax.value_and_grad(lambda *a: fn(*a).sum(), argnums=tuple(range(len(args))))
    walk(jax.make_jaxpr(grad)(*args).jaxpr)
    return found
