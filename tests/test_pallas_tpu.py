"""The Pallas TPU backend in interpret mode: head-dim padding, several chunks, resets, sub-chunks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from palimpsa_jax import kernels
from palimpsa_jax.kernels import api, chunking
from palimpsa_jax.kernels.palimpsa import naive, pallas_tpu
from references import random_inputs, relative_error


def _inputs(seed, B, T, H, Dk, Dv):
    """Backend arguments: a per-synapse prior (H, Dv, Dk) and the (B, T, H) reset mask."""
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(seed, B, T, H, Dk, Dv)
    rng = np.random.default_rng(seed + 1)
    M0 = rng.normal(size=(B, H, Dv, Dk)).astype(np.float32)
    Ibar0 = rng.uniform(0.0, 3.0, size=(B, H, Dv, Dk)).astype(np.float32)
    prior = prior[:, None, None] * rng.uniform(0.5, 2.0, size=(H, Dv, Dk)).astype(np.float32)
    reset, log_alpha = chunking.resets(jnp.asarray(segment_ids), log_alpha)
    return (q, k, v, beta, log_alpha, prior, M0, Ibar0), reset


def _loss(backend, reset, weights, **options):
    """A scalar touching o, the variance and the final (M, Ibar) of a backend function."""
    def f(*args):
        o, var, M, Ibar = backend(*args, reset, scale=0.3, return_variance=True, **options)
        return sum(jnp.sum(w * x) for w, x in zip(weights, (o, var, M, Ibar)))
    return f


@pytest.mark.parametrize("T,chunk_size,sub_chunk", [
    (45, 16, 4),      # 3 chunks (the last one padded), 4 recomputed sub-chunks per chunk
    (150, 128, None),  # the default chunk: 2 chunks, sub-chunks of 32
])
def test_backend_matches_reference_with_padded_heads(T, chunk_size, sub_chunk):
    """Dk = 48 -> 128 lanes, Dv = 40: forward, final state and every gradient vs the reference.

    The TPU interpret mode fills fresh buffers with NaN and raises on out-of-bounds reads, so
    this also checks that every output element is written and no read leaves its block.
    """
    interpret = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    B, H, Dk, Dv = 1, 2, 48, 40
    args, reset = _inputs(T, B, T, H, Dk, Dv)
    assert bool(jnp.any(reset)), "the inputs must contain segment resets"
    rng = np.random.default_rng(T)
    weights = [rng.normal(size=s).astype(np.float32)
               for s in [(B, T, H, Dv)] * 2 + [(B, H, Dv, Dk)] * 2]
    options = dict(chunk_size=chunk_size, sub_chunk=sub_chunk, interpret=interpret)
    out = pallas_tpu.palimpsa_pallas_tpu(*args, reset, scale=0.3, return_variance=True, **options)
    expected = naive.palimpsa_reference(*args, reset, scale=0.3, return_variance=True)
    for name, a, e in zip(["o", "variance", "M", "Ibar"], out, expected):
        assert a.shape == e.shape and a.dtype == jnp.float32, name
        assert relative_error(a, e) < 1e-5, name
    argnums = tuple(range(len(args)))
    grads = jax.grad(_loss(pallas_tpu.palimpsa_pallas_tpu, reset, weights, **options), argnums)(*args)
    grads_ref = jax.grad(_loss(naive.palimpsa_reference, reset, weights), argnums)(*args)
    names = ["q", "k", "v", "beta", "log_alpha", "prior", "M0", "Ibar0"]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.shape == g_ref.shape, name
        assert relative_error(g, g_ref) < 2e-5, name


def test_public_api_bf16_with_state_and_segments():
    """Through `palimpsa_attention`: bf16 inputs, an initial state, segments, T % C != 0."""
    B, T, H, Dk, Dv = 2, 19, 1, 48, 40
    q, k, v, beta, log_alpha, prior, segment_ids = random_inputs(3, B, T, H, Dk, Dv, jnp.bfloat16)
    rng = np.random.default_rng(4)
    state = (rng.normal(size=(B, H, Dv, Dk)).astype(np.float32),
             rng.uniform(0.2, 5.0, size=(B, H, Dv, Dk)).astype(np.float32))
    run = lambda backend, **kw: kernels.palimpsa_attention(
        q, k, v, beta, log_alpha, prior, initial_state=state, segment_ids=segment_ids,
        return_final_state=True, return_variance=True, backend=backend, **kw)
    o, (mu, importance), var = run("pallas_tpu", chunk_size=8, interpret=True)
    o_ref, (mu_ref, I_ref), var_ref = run("reference")
    assert o.dtype == jnp.bfloat16 and o.shape == (B, T, H, Dv)
    assert relative_error(o, o_ref) < 8e-3
    for actual, expected in [(mu, mu_ref), (importance, I_ref), (var, var_ref)]:
        assert relative_error(actual, expected) < 1e-5


def test_chunk_and_sub_chunk_are_validated():
    args, reset = _inputs(0, 1, 8, 1, 2, 2)
    for options, name in [(dict(chunk_size=0), "chunk_size"), (dict(chunk_size=2.0), "chunk_size"),
                          (dict(chunk_size=8, sub_chunk=3), "sub_chunk")]:
        with pytest.raises(ValueError, match=f"^{name} "):
            pallas_tpu.palimpsa_pallas_tpu(*args, reset, scale=1.0, return_variance=False, interpret=True,
                                **options)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="a TPU is present")
def test_needs_a_tpu_or_interpret_mode():
    q, k, v, beta, log_alpha, prior, _ = random_inputs(0, 1, 4, 1, 2, 2)
    with pytest.raises(ValueError, match="interpret=True"):
        kernels.palimpsa_attention(q, k, v, beta, log_alpha, prior, backend="pallas_tpu")


def test_auto_picks_pallas_tpu_on_tpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert api.resolve_backend("auto", kernels.PALIMPSA_BACKENDS)[0] is pallas_tpu.palimpsa_pallas_tpu
    assert api.resolve_backend("auto", kernels.GLA_BACKENDS)[0] is kernels.GLA_BACKENDS["xla"]


def test_lowers_to_mosaic_for_tpu(monkeypatch):
    """Forward and backward pass the Pallas -> Mosaic TPU lowering at Dk = Dv = 128, C = 128."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    B, T, H, D = 1, 256, 2, 128
    shapes = [(B, T, H, D)] * 4 + [(B, T, H), (H, D, D), (B, H, D, D), (B, H, D, D)]
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

    def loss(*args):
        outputs = pallas_tpu.palimpsa_pallas_tpu(*args, jnp.zeros((B, T, H), bool), scale=D**-0.5,
                                                 return_variance=True)
        return sum(jnp.sum(x) for x in outputs)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(8))))
    exported = jax.export.export(grad, platforms=["tpu"])(*specs)
    assert exported.mlir_module().count("tpu_custom_call") == 2  # forward and backward kernels
