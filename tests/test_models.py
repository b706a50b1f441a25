"""The causal language model: presets and their sizes, config validation, decoding with the
cache, packed sequences, sampling, weight-decay mask and sharding names."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from palimpsa_jax import kernels
from palimpsa_jax.layers import Attention, GatedDeltaNet, Mamba2, PalimpsaD, PalimpsaM
from palimpsa_jax.layers.common import embedding_lookup
from palimpsa_jax.models import (
    NOMINAL_SIZES,
    PRESETS,
    CausalLM,
    ModelConfig,
    count_params,
    generate,
    preset,
    weight_decay_mask,
)
from palimpsa_jax.models.generate import sample

HYBRID = ModelConfig(vocab_size=64, d_model=16, n_layers=3, num_heads=2, head_dim=4, expand_v=2,
                     beta_rank=3, ssm_state=4, ssm_head_dim=8, ssm_groups=2, mlp_hidden=24,
                     mixers=("palimpsa_d", "attention", "palimpsa_m"), backend="xla", chunk_size=4)
ALL_MIXERS = HYBRID.replace(mixers=("palimpsa_d", "mamba2", "gated_deltanet", "attention",
                                    "palimpsa_m"), n_layers=5)


@pytest.fixture(scope="module")
def hybrid():
    return nnx.jit(lambda: CausalLM(HYBRID, rngs=nnx.Rngs(0)))()


@nnx.jit
def forward(model, tokens, segment_ids=None, cache=None):
    return model(tokens, segment_ids=segment_ids, cache=cache)


def tokens(seed, batch, length, vocab=HYBRID.vocab_size):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, vocab, jnp.int32)


def relative_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", sorted(NOMINAL_SIZES))
def test_language_model_presets_land_within_5_percent(name):
    assert abs(count_params(PRESETS[name]) / NOMINAL_SIZES[name] - 1) < 0.05


def test_paper_and_mqar_presets():
    small = preset("palimpsa_d-170m")
    assert (small.d_model, small.n_layers, small.num_heads, small.head_dim, small.vocab_size,
            small.layer_mixers) == (768, 19, 16, 48, 32000, ("palimpsa_d",) * 19)
    for mixer in ("palimpsa_d", "palimpsa_m", "gated_deltanet", "mamba2", "attention"):
        config = preset(f"mqar-{mixer}")
        assert (config.d_model, config.n_layers, config.mlp_hidden, config.num_heads,
                config.head_dim, config.expand_v, config.vocab_size) == (128, 2, 0, 8, 16, 2, 8192)
    model = nnx.eval_shape(lambda: CausalLM(preset("mqar-mamba2"), rngs=nnx.Rngs(0)))
    assert (model.blocks[0].mixer.num_heads, model.blocks[0].mixer.head_dim) == (8, 32)
    assert preset("mamba2-170m", n_layers=2).n_layers == 2
    with pytest.raises(ValueError, match="name"):
        preset("palimpsa_d-7b")


@pytest.mark.parametrize("field, value", [
    ("mixers", ("palimpsa_d", "lstm")), ("mixers", ()), ("d_model", -8), ("num_heads", 0),
    ("head_dim", 2.5), ("mlp_hidden", -1), ("n_layers", 3), ("ssm_head_dim", 24),
    ("ssm_groups", 3), ("backend", "cuda"), ("chunk_size", 0), ("norm_eps", 0.0)])
def test_bad_configs_raise_naming_the_field(field, value):
    valid = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "mixers": ("palimpsa_d", "mamba2"),
                 "ssm_head_dim": 16}
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**valid, field: value})


def test_odd_head_dim_for_attention_is_rejected():
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(vocab_size=64, d_model=32, n_layers=1, mixers=("attention",), head_dim=5)


@pytest.mark.parametrize("changes", [{}, {"forget_init": "ramp", "conv_init_std": 0.3, "learn_prior": True,
                                          "prior_family": "synapse", "tie_embeddings": False}])
def test_eager_construction_draws_the_values_of_a_jitted_one(changes):
    """Trainer.init_state builds the model eagerly: bitwise the parameters of jit(CausalLM)."""
    config = ALL_MIXERS.replace(mixers=ALL_MIXERS.mixers + ("rule_mesa",), n_layers=6, **changes)
    eager = nnx.state(CausalLM(config, rngs=nnx.Rngs(3)))
    jitted = jax.jit(lambda: nnx.state(CausalLM(config, rngs=nnx.Rngs(3))))()
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hybrid_layers_follow_the_pattern():
    model = nnx.eval_shape(lambda: CausalLM(ALL_MIXERS, rngs=nnx.Rngs(0)))
    expected = (PalimpsaD, Mamba2, GatedDeltaNet, Attention, PalimpsaM)
    assert tuple(type(block.mixer) for block in model.blocks) == expected
    pattern = dataclasses.replace(HYBRID, mixers=("mamba2", "palimpsa_m"), n_layers=4)
    assert pattern.layer_mixers == ("mamba2", "palimpsa_m") * 2


def test_prefill_then_decode_equals_full_forward(hybrid):
    x = tokens(1, 2, 8)
    full, none = forward(hybrid, x)
    assert none is None and full.shape == (2, 8, HYBRID.vocab_size) and full.dtype == jnp.float32
    logits, cache = forward(hybrid, x[:, :5], cache=hybrid.init_cache(2, 8))
    steps = [logits]
    for t in range(5, 8):
        logits, cache = forward(hybrid, x[:, t:t + 1], cache=cache)
        steps.append(logits)
    assert relative_error(jnp.concatenate(steps, axis=1), full) < 1e-5


def test_packed_sequences_equal_separate_ones(hybrid):
    x = tokens(2, 1, 9)
    packed, _ = forward(hybrid, x, jnp.array([[3] * 4 + [7] * 5], jnp.int32))
    first, _ = forward(hybrid, x[:, :4])
    second, _ = forward(hybrid, x[:, 4:])
    assert relative_error(packed, jnp.concatenate([first, second], axis=1)) < 1e-5


def test_greedy_generation_follows_the_full_forward(hybrid):
    prompt = tokens(3, 2, 5)
    new = generate(hybrid, prompt, 4, temperature=0.0)
    assert new.shape == (2, 4) and new.dtype == jnp.int32
    logits, _ = forward(hybrid, jnp.concatenate([prompt, new], axis=1))
    np.testing.assert_array_equal(jnp.argmax(logits[:, 4:-1], axis=-1), new)
    np.testing.assert_array_equal(generate(hybrid, prompt, 4, top_k=1, rng=jax.random.PRNGKey(1)), new)
    with pytest.raises(ValueError, match="top_k"):
        generate(hybrid, prompt, 4, top_k=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.01, 1.0))
def test_nucleus_sampling_draws_from_the_nucleus_only(seed, top_p):
    """Every token `sample` draws with top_p lies in the nucleus computed by hand (the most
    probable tokens whose mass in decreasing order first reaches top_p), and every nucleus token
    is drawn over many draws; top_p = 1 changes nothing."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=6).astype(np.float32) * 2
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[before < top_p].tolist())
    keys = jax.random.split(jax.random.PRNGKey(seed), 4000)
    draw = jax.vmap(lambda key: sample(jnp.asarray(logits)[None], key, temperature=1.0,
                                       top_k=None, top_p=top_p)[0])
    drawn = set(np.asarray(draw(keys)).tolist())
    assert drawn <= nucleus
    kept = probs[list(nucleus)] / probs[list(nucleus)].sum()
    if kept.min() > 0.005:                       # each seen with probability > 1 - 1e-8
        assert drawn == nucleus
    full = jax.vmap(lambda key: sample(jnp.asarray(logits)[None], key, temperature=1.0,
                                       top_k=None, top_p=1.0)[0])
    plain = jax.vmap(lambda key: sample(jnp.asarray(logits)[None], key, temperature=1.0,
                                        top_k=None)[0])
    np.testing.assert_array_equal(full(keys[:100]), plain(keys[:100]))


def test_generation_with_a_tiny_nucleus_is_greedy(hybrid):
    prompt = tokens(3, 2, 5)
    greedy = generate(hybrid, prompt, 4, temperature=0.0)
    np.testing.assert_array_equal(generate(hybrid, prompt, 4, top_p=1e-6), greedy)
    with pytest.raises(ValueError, match="top_p"):
        generate(hybrid, prompt, 4, top_p=0.0)


def test_recurrent_cache_does_not_grow_with_length():
    config = ALL_MIXERS.replace(mixers=("palimpsa_d", "mamba2", "gated_deltanet", "palimpsa_m"),
                                n_layers=4)
    size = lambda length: sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        lambda: CausalLM(config, rngs=nnx.Rngs(0)).init_cache(1, length))))
    assert size(16) == size(4096)


def test_weight_decay_mask_and_sharding_names():
    model = nnx.eval_shape(lambda: CausalLM(ALL_MIXERS, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    mask = dict(nnx.to_flat_state(weight_decay_mask(model)))
    exempt = {"A_log", "dt_bias", "D", "b_scale", "Ip_log", "scale", "bias"}
    for path, variable in flat:
        assert mask[path] == (path[-1] not in exempt), path
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable.ndim and set(names) <= {
            "embed", "heads", "mlp", "vocab", "conv", "rank"}, (path, names)
    assert not any(path[-1] == "Ip_log" for path, _ in flat)   # the prior is fixed by default
    learned = nnx.eval_shape(lambda: CausalLM(HYBRID.replace(learn_prior=True), rngs=nnx.Rngs(0)))
    assert any(path[-1] == "Ip_log" for path, _ in nnx.to_flat_state(nnx.state(learned, nnx.Param)))


def test_untied_head_adds_vocab_times_d_model():
    tied = HYBRID.replace(mixers=("attention",), n_layers=1)
    assert count_params(tied.replace(tie_embeddings=False)) - count_params(tied) == 64 * 16


def test_language_model_gradients_finite_in_bfloat16():
    config = HYBRID.replace(dtype="bfloat16", mixers=("palimpsa_d",), n_layers=1)
    model = nnx.jit(lambda: CausalLM(config, rngs=nnx.Rngs(0)))()
    x = tokens(4, 2, 8)

    def loss(model):
        logits, _ = model(x[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], -1))

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    assert np.isfinite(float(value))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@settings(max_examples=6, deadline=None)
@given(vocab=st.integers(1, 40), shape=st.tuples(st.integers(1, 3), st.integers(1, 50)),
       zeros=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_embedding_gradient_equals_the_scatter_add(vocab, shape, zeros, seed):
    """The sort-and-segment-sum gradient of `embedding_lookup` is the gather's scatter-add
    gradient (float64), with many repeated ids (a fraction `zeros` of token 0)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(vocab, 5))
    tokens = np.where(rng.uniform(size=shape) < zeros, 0, rng.integers(0, vocab, size=shape))
    weights = rng.normal(size=(*shape, 5))
    ours = jax.grad(lambda t: jnp.sum(embedding_lookup(t, tokens) * weights))(table)
    expected = np.zeros_like(table)
    np.add.at(expected, tokens.reshape(-1), weights.reshape(-1, 5))
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(embedding_lookup(table, tokens), table[tokens])


def test_pallas_gpu_models_train_like_xla(monkeypatch):
    """A model of the three recurrent mixers, trained 3 AdamW steps in float32 on the pallas_gpu
    kernels (Pallas interpret mode on CPU) and on the xla ones: the same losses, step by step,
    and the same parameters after them."""
    for registry in (kernels.PALIMPSA_BACKENDS, kernels.GLA_BACKENDS,
                     kernels.GATED_DELTA_BACKENDS):
        monkeypatch.setitem(registry, "pallas_gpu",
                            functools.partial(registry["pallas_gpu"], interpret=True))
    x = tokens(5, 2, 11)

    def loss(model):
        logits, _ = model(x[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], -1))

    def train(backend):
        config = HYBRID.replace(mixers=("palimpsa_d", "mamba2", "gated_deltanet"),
                                backend=backend)
        model = nnx.jit(lambda: CausalLM(config, rngs=nnx.Rngs(0)))()
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        losses = [float(step(model, optimizer)) for _ in range(3)]
        return losses, jax.tree.leaves(nnx.state(model, nnx.Param))

    (losses, params), (losses_ref, params_ref) = train("pallas_gpu"), train("xla")
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    assert losses[-1] < losses[0]
    for p, p_ref in zip(params, params_ref):
        assert relative_error(p, p_ref) < 1e-4
