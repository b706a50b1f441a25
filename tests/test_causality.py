"""Causality whatever the values: a NaN or inf planted at one token leaves every earlier output
bit-identical, on every backend of the three kernels (jitted, since eager calls refuse non-finite
inputs); alpha = 0 (log_alpha = -inf) is a clean reset."""
import functools

import numpy as np
import pytest

import backends
from palimpsa_jax import kernels
from references import gated_delta_numpy, gla_numpy, palimpsa_numpy, random_inputs, relative_error

B, T, H, DK, DV, CHUNK = 2, 40, 2, 3, 4, 16

# kernel name -> (kernel, backends, its arguments from random_inputs, the float64 reference)
KERNELS = {
    "palimpsa": (kernels.palimpsa_attention, sorted(kernels.PALIMPSA_BACKENDS),
                 ("q", "k", "v", "beta", "log_alpha", "prior"),
                 lambda a, s: palimpsa_numpy(*a, s)[0]),
    "gla": (kernels.gla_attention, sorted(kernels.GLA_BACKENDS), ("q", "k", "v", "log_alpha"),
            lambda a, s: gla_numpy(*a, s)[0]),
    "gated_delta": (kernels.gated_delta_attention, sorted(kernels.GATED_DELTA_BACKENDS),
                    ("q", "k", "v", "beta", "log_alpha"),
                    lambda a, s: gated_delta_numpy(*a, s)[0]),
}
CASES = [(name, backend) for name, (_, names, _, _) in KERNELS.items() for backend in names]


def inputs(kernel_name: str, seed: int) -> dict:
    q, k, v, beta, log_alpha, prior, _ = random_inputs(seed, B, T, H, DK, DV)
    if kernel_name == "gated_delta":
        beta = beta[..., 0] / 2              # a scalar write strength per token, in (0, 1)
    values = dict(q=q, k=k, v=v, beta=beta, log_alpha=log_alpha, prior=prior)
    return {name: values[name] for name in KERNELS[kernel_name][2]}


def run(kernel_name, backend, args):
    kernel = KERNELS[kernel_name][0]
    return np.asarray(backends.call(kernel, backend, *args.values(), chunk_size=CHUNK))


@pytest.mark.parametrize("kernel_name,backend", CASES)
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_non_finite_input_leaves_earlier_outputs_bit_identical(kernel_name, backend, bad):
    rng = np.random.default_rng(abs(hash((kernel_name, backend, str(bad)))) % 2**32)
    args = inputs(kernel_name, seed=0)
    clean = run(kernel_name, backend, args)
    assert np.all(np.isfinite(clean))
    for name in [n for n in args if n != "prior"]:
        token = int(rng.integers(1, T))
        batch, head = int(rng.integers(B)), int(rng.integers(H))
        planted = {**args, name: np.array(args[name], copy=True)}
        where = (batch, token, head) + ((int(rng.integers(planted[name].shape[-1])),)
                                        if planted[name].ndim == 4 else ())
        planted[name][where] = bad            # log_alpha = +inf: -inf is a legal reset
        out = run(kernel_name, backend, planted)
        np.testing.assert_array_equal(out[:, :token], clean[:, :token],
                                      err_msg=f"{name} at token {token}")
        if np.isnan(bad):   # (an infinite beta is infinite precision: a finite read-out of 0)
            assert not np.all(np.isfinite(out[batch, token:, head])), f"{name}: NaN vanished"
        other = 1 - batch   # the other sequence of the batch never sees it
        np.testing.assert_array_equal(out[other], clean[other], err_msg=name)


@pytest.mark.parametrize("kernel_name,backend", CASES)
def test_zero_forget_gate_is_a_clean_reset(kernel_name, backend):
    """log_alpha = -inf at some tokens: finite outputs equal to the float64 reference, and equal
    to restarting the sequence at those tokens (a new segment id)."""
    args = inputs(kernel_name, seed=1)
    rng = np.random.default_rng(2)
    resets = rng.uniform(size=(B, T, H)) < 0.15
    args["log_alpha"] = np.where(resets, -np.inf, args["log_alpha"]).astype(np.float32)
    out = run(kernel_name, backend, args)
    assert np.all(np.isfinite(out))
    reference = KERNELS[kernel_name][3](tuple(args.values()), DK**-0.5)
    assert relative_error(out, reference) < 1e-5


def test_eager_calls_refuse_nan_but_accept_minus_inf():
    args = inputs("palimpsa", seed=3)
    args["log_alpha"] = np.where(np.arange(H) == 0, -np.inf, args["log_alpha"]).astype(np.float32)
    assert np.all(np.isfinite(kernels.palimpsa_attention(*args.values(), backend="xla")))
    args["v"] = np.where(np.arange(DV) == 0, np.nan, args["v"]).astype(np.float32)
    with pytest.raises(ValueError, match="^v contains NaN or inf"):
        functools.partial(kernels.palimpsa_attention, backend="xla")(*args.values())
