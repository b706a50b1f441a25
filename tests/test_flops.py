"""Model FLOPs (`palimpsa_jax.models.flops`): the analytic forward count against XLA's own count
of the compiled forward, exact identities of the count, and the trainer's train/mfu."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.kernels.palimpsa.chunk import DEFAULT_CHUNK_SIZE as PALIMPSA_CHUNK
from palimpsa_jax.models import CausalLM, ModelConfig, count_params, flops
from palimpsa_jax.training import ConfigError, Trainer, train_and_evaluate

# Wide (d_model 512, SwiGLU 1024) and short (T = one chunk of 16): the projections dominate.
# One chunk, because XLA counts the body of a while loop (a scan over chunks) once.
WIDE = dict(vocab_size=256, d_model=512, n_layers=1, num_heads=4, head_dim=64, ssm_state=64,
            mlp_hidden=1024, backend="xla", chunk_size=16)

# XLA's count minus the analytic one is then the elementwise work the convention leaves out
# (norms, SiLU, gates, RoPE, softmax, convolution selects): measured at +0.3% to +0.6% of the
# total for every mixer. The tolerance, 2%, is a third of the smallest mistake the test guards
# against: the MLP counted twice (+42% to +86%) or one of W_q, W_k, W_v, W_g left out (+2.7% for
# Gated DeltaNet, the least). Attention over 256 keys (the scores dominate) has its softmax on
# every score, +1.6% measured: 3%; counting the causal half of the scores would be off by 22%.
CASES = {   # name: (config, T, relative tolerance)
    "attention": (ModelConfig(mixers=("attention",), **WIDE), 16, 0.02),
    "attention_256_keys": (ModelConfig(vocab_size=256, d_model=128, n_layers=1, num_heads=4,
                                       head_dim=64, mixers=("attention",), backend="xla"),
                           256, 0.03),
    "mamba2": (ModelConfig(mixers=("mamba2",), **WIDE), 16, 0.02),
    "gated_deltanet": (ModelConfig(mixers=("gated_deltanet",), **WIDE), 16, 0.02),
    "palimpsa_d": (ModelConfig(mixers=("palimpsa_d",), **WIDE), 16, 0.02),
    "palimpsa_m": (ModelConfig(mixers=("palimpsa_m",), **WIDE), 16, 0.02),
    # a rule mixer scans its tokens: with T = 1 XLA counts all of it (+0.1%, +0.3% measured)
    "rule_palimpsa": (ModelConfig(mixers=("rule_palimpsa",), **WIDE), 1, 0.02),
    "rule_gated_deltanet": (ModelConfig(mixers=("rule_gated_deltanet",), **WIDE), 1, 0.02),
}


def xla_forward_flops(config: ModelConfig, batch: int, length: int) -> float:
    """XLA's FLOPs per token of the compiled forward on (batch, length) tokens (abstract
    parameters: nothing is allocated or run)."""
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    forward = lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0]
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    cost = jax.jit(forward).lower(state, tokens).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):        # one dict per program in older jax versions
        cost = cost[0]
    return cost["flops"] / (batch * length)


def xla_backend_extra(config: ModelConfig, length: int) -> float:
    """What the chunked XLA Palimpsa backend computes beyond the model FLOPs, per token: the
    (C x C) @ (C x 2 Dv Dk) decay matmul that forms every token's (M, Ibar) (flops module
    docstring)."""
    chunk = min(config.chunk_size or PALIMPSA_CHUNK, length)
    extra = 0.0
    for mixer in config.layer_mixers:
        if mixer == "palimpsa_d":
            heads, dk, dv = config.num_heads, config.head_dim, config.expand_v * config.head_dim
        elif mixer == "palimpsa_m":
            heads = config.ssm_expand * config.d_model // config.ssm_head_dim
            dk, dv = config.ssm_state, config.ssm_head_dim
        else:
            continue
        extra += heads * 4.0 * chunk * dk * dv
    return extra


@pytest.mark.parametrize("name", CASES)
def test_forward_flops_match_xla(name):
    config, length, tolerance = CASES[name]
    measured = xla_forward_flops(config, 2, length)
    analytic = flops.forward_flops_per_token(config, length)
    ratio = measured / (analytic + xla_backend_extra(config, length))
    assert ratio == pytest.approx(1.0, abs=tolerance), (name, ratio)
    # the test can fail: a second MLP (or, without one, the attention scores) is far outside it
    mlp = config.n_layers * 3 * flops.linear(config.d_model, config.mlp_hidden)
    guard = mlp or config.n_layers * flops.attention_core(config.num_heads, config.head_dim,
                                                          length) / 2
    assert guard / analytic > 3 * tolerance


def test_transformer_is_palms_6n_plus_12lhdt():
    """Attention with SwiGLU and a tied head: exactly 6 N + 12 L H Dh T per training token, N the
    parameters that multiply activations (all but the norm scales; the tied embedding once)."""
    config = ModelConfig(vocab_size=320, d_model=96, n_layers=3, mixers=("attention",),
                         num_heads=3, head_dim=16, mlp_hidden=160)
    norms = (2 * config.n_layers + 1) * config.d_model
    matmul_params = count_params(config) - norms
    for length in (1, 128, 2048):
        assert flops.train_flops_per_token(config, length) == (
            6 * matmul_params + 12 * config.n_layers * config.num_heads * config.head_dim * length)


@pytest.mark.parametrize("mixers", [("palimpsa_d",), ("mamba2", "palimpsa_m"),
                                    ("gated_deltanet", "attention"), ("rule_mesa",)])
def test_count_is_linear_in_layers_and_train_is_three_forwards(mixers):
    base = ModelConfig(vocab_size=100, d_model=64, n_layers=len(mixers), mixers=mixers,
                       num_heads=2, head_dim=32, ssm_head_dim=32, ssm_state=16, mlp_hidden=96)
    counts = [flops.forward_flops_per_token(base.replace(n_layers=k * len(mixers)), 64)
              for k in (1, 2, 3)]
    exact = lambda x: pytest.approx(x, rel=1e-12)       # float sums (C² / 3 is not an integer)
    assert counts[2] - counts[1] == exact(counts[1] - counts[0])
    head = flops.linear(base.d_model, base.vocab_size)
    assert counts[0] - head == exact(sum(flops.mixer_flops(base, m, 64) for m in mixers) + len(
        mixers) * 3 * flops.linear(base.d_model, base.mlp_hidden))
    assert flops.train_flops_per_token(base, 64) == 3 * counts[0]


def test_unknown_mixers_have_no_count():
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="no FLOP count for mixer 'my_mixer'"):
        flops.mixer_flops(config, "my_mixer", 16)


def test_peak_table():
    assert flops.peak_flops("NVIDIA H200") == flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB") == flops.peak_flops("NVIDIA A100 80GB PCIe")
    assert flops.peak_flops("TPU v5 lite") == 197e12 and flops.peak_flops("TPU v5") == 459e12
    assert flops.peak_flops("TPU v6 lite") == 918e12 and flops.peak_flops("TPU v4") == 275e12
    for unknown in ("cpu", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "TPU v4 lite"):
        assert flops.peak_flops(unknown) is None
    assert flops.mfu(1e4, 1e9, 1e14) == pytest.approx(0.1)


# --- the trainer ----------------------------------------------------------------------------

def tiny_config(**changes):
    """tests/test_training.py's tiny MQAR run, 2 steps of one attention layer (the quickest to
    compile; what is logged does not depend on the mixer)."""
    config = common.cpu("palimpsa_d")
    for key, value in {
        "model.vocab_size": 64, "model.d_model": 64, "model.num_heads": 4, "model.head_dim": 16,
        "model.mixers": ("attention",), "model.n_layers": 1, "data.vocab_size": 64,
        "data.seq_len": 32,
        "data.num_pairs": 4, "data.num_train": 64, "data.num_test": 16,
        "data.eval_slices": ((32, 4),), "batch_size": 16, "train.steps": 2,
        "optim.warmup_steps": 1, "log.every_steps": 1, "log.diagnostics_every_steps": 0,
        "log.progress": False, "eval.every_steps": 0, "eval.batch_size": 16,
        "checkpoint.async_save": False, **changes,
    }.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config)[name] = value
    return config


def scalar_tags(workdir) -> dict:
    events = EventAccumulator(str(workdir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_trainer_logs_mfu_against_log_peak_flops(tmp_path, capsys):
    peak = 1e12
    final = train_and_evaluate(tiny_config(**{"log.peak_flops": peak}), tmp_path)
    trainer = Trainer(tiny_config(**{"log.peak_flops": peak}))
    per_token = flops.train_flops_per_token(trainer.model_config, 32)
    assert trainer.flop_rate.flops_per_token == per_token and trainer.flop_rate.peak == peak
    assert final["train/mfu"] == pytest.approx(final["train/tokens_per_s"] * per_token / peak)
    assert 0 < final["train/mfu"] < 1
    tags = scalar_tags(tmp_path)
    assert len(tags["train/mfu"]) == len(tags["train/tokens_per_s"]) == 2
    summary = capsys.readouterr().out
    assert f"{per_token / 1e3:.4g} kFLOP per token (train, 3 x forward)" in summary
    assert "MFU against 1 TFLOP/s x 1 device(s) (log.peak_flops)" in summary


def test_no_mfu_on_cpu_without_log_peak_flops(tmp_path, capsys):
    final = train_and_evaluate(tiny_config(), tmp_path)
    assert "train/tokens_per_s" in final and "train/mfu" not in final
    assert "train/mfu" not in scalar_tags(tmp_path)
    assert ("MFU not logged: no peak FLOP/s known for device kind 'cpu' (set log.peak_flops)"
            in capsys.readouterr().out)


@pytest.mark.parametrize("value", [0.0, -1e12, float("inf"), float("nan")])
def test_bad_log_peak_flops_is_a_config_error(value):
    with pytest.raises(ConfigError, match="log.peak_flops must be a positive number"):
        Trainer(tiny_config(**{"log.peak_flops": value}))
