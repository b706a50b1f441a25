"""The researcher's loop: loading a run, probing its memories (against the kernels' own
arguments and float64 references), the measures (against hand computations and closed forms),
the analyze and eval commands, and variants defined outside the library."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax import kernels
from palimpsa_jax.analysis import inspect, load_run, measures, probe, uncertainty
from palimpsa_jax.analysis.report import held_out_batch
from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.kernels import rules
from palimpsa_jax.models import CausalLM, ModelConfig
from palimpsa_jax.training import train_and_evaluate
from palimpsa_jax.training.trainer import token_metrics
from references import full_prior, palimpsa_numpy, relative_error

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(d_model=32, num_heads=2, head_dim=8, expand_v=1, beta_rank=4, vocab_size=32,
            learn_prior=True, prior_family="row")


def tiny_config(steps=30, **model):
    c = common.cpu("palimpsa_d")
    c.model.update(**{**TINY, **model})
    c.data.update(vocab_size=32, seq_len=16, num_pairs=2, num_train=512, num_test=32,
                  eval_slices=((16, 2),))
    c.batch_size, c.train.steps = 8, steps
    c.optim.warmup_steps = 5
    c.checkpoint.update(every_steps=15, async_save=False)
    c.log.update(every_steps=5, diagnostics_every_steps=15, progress=False)
    c.eval.update(every_steps=0, batch_size=16)
    return c


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    train_and_evaluate(tiny_config(), workdir)
    return workdir


def test_load_run_restores_the_checkpoint(run_dir):
    run = load_run(run_dir)
    assert run.step == 30 and run.config.model.prior_family == "row"
    batch = held_out_batch(run.config, 32)              # the whole test split
    logits, _ = run.model(batch["tokens"])
    _, correct, count = token_metrics(logits, jnp.asarray(batch["labels"]))
    final = json.loads((run_dir / "metrics.json").read_text())
    assert float(correct / count) == pytest.approx(final["eval/accuracy"], abs=1e-6)
    earlier = load_run(run_dir, 15)
    assert earlier.step == 15
    prior = lambda r: np.asarray(r.model.blocks[0].mixer.memory.prior())
    assert prior(earlier).shape == (2, 8) and not np.allclose(prior(earlier), prior(run))


def test_probe_records_the_kernels_own_arguments(monkeypatch):
    """What the probe returns is exactly what the mixers passed to palimpsa_attention."""
    model = CausalLM(ModelConfig(n_layers=2, **TINY), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 32)
    seen = []
    original = kernels.palimpsa_attention

    def spy(*args, **kwargs):
        seen.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "palimpsa_attention", spy)
    model(tokens)
    monkeypatch.setattr(kernels, "palimpsa_attention", original)
    layers = probe(model, tokens).layers
    assert sorted(layers) == [0, 1] and len(seen) == 2
    for args, inputs in zip(seen, layers.values()):
        for name, value in zip(("q", "k", "v", "beta", "log_alpha", "prior"), args):
            np.testing.assert_array_equal(inputs[name], value, err_msg=name)
        assert float(inputs["scale"]) == pytest.approx(8**-0.5)


def test_inspect_matches_a_float64_reference():
    """Posterior after the sequence and at positions, mean importance after every token and the
    predictive variance, against the (mu, I) equations in float64 on the probed inputs."""
    model = CausalLM(ModelConfig(n_layers=1, **{**TINY, "prior_family": "synapse"}),
                     rngs=nnx.Rngs(2))
    nnx.update(model, jax.tree.map(lambda x: x + 0.3, nnx.state(model, nnx.Param)))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, 32)
    _, layers = inspect(model, tokens, positions=(3, 9))
    inputs = probe(model, tokens).layers[0]
    memory = layers[0]
    arrays = [np.asarray(inputs[n], np.float64) for n in ("q", "k", "v", "beta", "log_alpha")]
    prior, scale = np.asarray(inputs["prior"], np.float64), float(inputs["scale"])
    reference = lambda length: palimpsa_numpy(*(a[:, :length] for a in arrays), prior, scale)
    _, (mu, importance), variance = reference(10)
    assert relative_error(memory.final.mu, mu) < 1e-5
    assert relative_error(memory.final.importance, importance) < 1e-5
    assert relative_error(memory.variance, variance) < 1e-5
    for i, p in enumerate((3, 9)):
        _, (mu_p, importance_p), _ = reference(p + 1)
        assert relative_error(memory.at.importance[:, i], importance_p) < 1e-5
        assert relative_error(memory.at.mu[:, i], mu_p) < 1e-5
    means = np.stack([reference(t + 1)[1][1].mean(axis=(-2, -1)) for t in range(10)], axis=1)
    assert relative_error(memory.mean_importance, means) < 1e-5
    np.testing.assert_allclose(memory.window, 1 / (1 - np.exp(arrays[4])), rtol=1e-5)


def test_kl_to_prior_is_the_closed_form():
    """Against a numerical integral of q log(q / p) for 1-D Gaussians."""
    grid = np.linspace(-30, 30, 600_001)
    for mu, importance, prior in [(0.0, 1.0, 1.0), (0.7, 3.0, 1.0), (-2.0, 0.5, 2.0), (1.5, 40.0, 0.3)]:
        log_q = 0.5 * np.log(importance / (2 * np.pi)) - 0.5 * importance * (grid - mu) ** 2
        log_p = 0.5 * np.log(prior / (2 * np.pi)) - 0.5 * prior * grid**2
        numeric = np.trapezoid(np.exp(log_q) * (log_q - log_p), grid)
        ours = measures.kl_to_prior(np.full((1, 1, 1, 1), mu), np.full((1, 1, 1, 1), importance),
                                    np.full(1, prior))
        assert float(ours[0, 0]) == pytest.approx(numeric, rel=1e-6, abs=1e-9)


def test_measures_by_hand():
    rng = np.random.default_rng(0)
    B, H, Dv, Dk = 3, 2, 4, 5
    prior = rng.uniform(0.5, 2.0, size=(H, Dv))
    importance = full_prior(prior, H, Dv, Dk)[None] * rng.uniform(1.0, 8.0, size=(B, H, Dv, Dk))
    ratio = importance / full_prior(prior, H, Dv, Dk)[None]
    per_head = np.moveaxis(ratio, 1, 0).reshape(H, -1)
    np.testing.assert_allclose(measures.ratio_quantiles(importance, prior),
                               np.quantile(per_head, measures.QUANTILES, axis=1), rtol=1e-6)
    np.testing.assert_allclose(measures.consolidated_fraction(importance, prior, 4.0),
                               (ratio > 4.0).mean(axis=(2, 3)))
    q10, q90 = np.quantile(per_head, [0.1, 0.9], axis=1)
    np.testing.assert_allclose(measures.metaplasticity_ratio(importance, prior), q90 / q10, rtol=1e-6)
    log_alpha = -rng.uniform(1e-3, 1.0, size=(B, 7, H))
    windows = (1 / (1 - np.exp(log_alpha))).reshape(-1, H)
    np.testing.assert_allclose(measures.window_quantiles(log_alpha, (0.5,))[0],
                               np.median(windows, axis=0), rtol=1e-5)


def test_auroc_and_buckets_by_hand():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 6, size=200).astype(float)       # many ties
    positives = rng.uniform(size=200) < 0.3 + 0.1 * scores
    pos, neg = scores[positives], scores[~positives]
    brute = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
    assert measures.auroc(scores, positives) == pytest.approx(brute)
    assert np.isnan(measures.auroc(scores, np.zeros(200, bool)))
    half = np.abs(rng.normal(size=50)) + 1e-3
    values = rng.permutation(np.concatenate([-half, half]))     # 50 below zero, 50 above
    edges, means, counts = measures.by_quantile_bucket(values, values > 0, 4)
    assert counts.tolist() == [25] * 4 and means[0] == 0.0 and means[-1] == 1.0
    tokens = uncertainty.ScoredTokens(values, values < 0, values**2)   # errors: variance >= 0
    calibration = uncertainty.calibration(tokens, 4)
    assert calibration.auroc == pytest.approx(1.0)             # every error has a larger variance
    assert calibration.accuracy.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert calibration.count.tolist() == [25] * 4


def command(module: str, *args, devices: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_analyze_command_writes_the_report(run_dir):
    """On 2 simulated devices: the run (trained on one) loads onto a mesh of two."""
    result = command("palimpsa_jax.commands.analyze", f"--workdir={run_dir}", "--sequences=32",
                     devices=2)
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_dir / "analysis"
    for name in ("report.md", "analysis.json", "importance_over_tokens.png",
                 "importance_histograms.png", "kl_and_windows.png", "uncertainty.png",
                 "metaplasticity_over_training.png"):
        assert (out / name).stat().st_size > 0, name
    analysis = json.loads((out / "analysis.json").read_text())
    final = json.loads((run_dir / "metrics.json").read_text())
    assert analysis["uncertainty"]["accuracy"] == pytest.approx(final["eval/accuracy"], abs=1e-6)
    assert sorted(analysis["metaplasticity_over_training"]) == ["15", "30"]
    for layer in analysis["layers"].values():
        assert min(layer["ratio_quantiles"]["0.1"]) >= 1 - 1e-5
        assert min(layer["kl_to_prior"]) >= 0
    assert "| layer | head | median I/prior" in (out / "report.md").read_text()


def test_analysis_of_a_language_model(tmp_path):
    """On text: the report relates the variance to the per-token loss."""
    from palimpsa_jax.analysis.report import analyze
    from palimpsa_jax.data import write_corpus
    from palimpsa_jax.experiments.lm import palimpsa_d as lm
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, 64, size=rng.integers(3, 30)).tolist() for _ in range(40)]
    write_corpus(tmp_path / "train.npy", documents, eos_id=2)
    c = lm.get_config()
    c.model.update(vocab_size=64, d_model=32, n_layers=1, num_heads=2, head_dim=8, mlp_hidden=32,
                   beta_rank=4)
    c.data.update(path=str(tmp_path / "train.npy"), test_path=str(tmp_path / "train.npy"),
                  seq_len=16)
    c.batch_size, c.train.steps, c.optim.warmup_steps = 4, 3, 1
    c.checkpoint.update(every_steps=0, async_save=False)
    c.log.update(progress=False, diagnostics_every_steps=0)
    c.eval.update(every_steps=0, batch_size=4)
    train_and_evaluate(c, tmp_path / "run")
    result = analyze(tmp_path / "run", size=8)
    assert -1 <= result["uncertainty"]["spearman_variance_loss"] <= 1
    assert sum(result["uncertainty"]["count_by_bucket"]) > 0
    assert (tmp_path / "run" / "analysis" / "report.md").exists()


def test_eval_command_on_new_settings(run_dir):
    result = command("palimpsa_jax.commands.evaluate", f"--workdir={run_dir}",
                     "--config.data.eval_slices=((16, 2), (32, 4))")
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = json.loads((run_dir / "eval_30.json").read_text())
    final = json.loads((run_dir / "metrics.json").read_text())
    assert evaluation["eval/seq16_pairs2/accuracy"] == pytest.approx(
        final["eval/seq16_pairs2/accuracy"], abs=1e-6)
    assert 0 <= evaluation["eval/seq32_pairs4/accuracy"] <= 1
    bad = command("palimpsa_jax.commands.evaluate", f"--workdir={run_dir}", "--config.data.nope=1")
    assert bad.returncode == 1 and "--config.data.nope: unknown config key" in bad.stderr
    assert "Traceback" not in bad.stderr


EXPERIMENT = '''
"""An experiment outside the library: a Gated DeltaNet whose beta is a constant, and a beta rule
that ignores the hidden state."""
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.layers import GatedDeltaNet, register_beta_rule, register_mixer


class ConstantBetaDeltaNet(GatedDeltaNet):
    def _memory(self, x, q, k, x_v, log_alpha, state, segment_ids):
        beta = jnp.full(q.shape[:3], 0.5, q.dtype)
        return self.memory(q, k, x_v, beta, log_alpha, state=state, segment_ids=segment_ids)


class GateOnlyBeta(nnx.Module):
    def __init__(self, d_model, num_heads, dv, *, rank, std, dtype, rngs):
        self.num_heads, self.dv = num_heads, dv

    def __call__(self, x, input_gate):
        return jnp.broadcast_to(input_gate[..., None], (*input_gate.shape, self.dv))


register_mixer("constant_beta_deltanet", lambda c, **kw: ConstantBetaDeltaNet(
    c.d_model, c.num_heads, c.head_dim, expand_v=c.expand_v, init=c.init, **kw))
register_beta_rule("gate_only", GateOnlyBeta)


def get_config(arg=None):
    c = common.cpu("palimpsa_d")
    mixers = ("constant_beta_deltanet", "palimpsa_d")
    c.model.update(mixers=mixers, beta_rule="gate_only", d_model=32, num_heads=2, head_dim=8,
                   expand_v=1, beta_rank=4, vocab_size=32)
    c.data.update(vocab_size=32, seq_len=16, num_pairs=2, num_train=256, num_test=16,
                  eval_slices=((16, 2),))
    c.batch_size, c.train.steps = 8, 4
    c.optim.warmup_steps = 1
    c.checkpoint.every_steps = 0
    c.log.update(every_steps=1, diagnostics_every_steps=2, progress=False)
    c.eval.update(every_steps=0, batch_size=16)
    return c
'''


def test_an_experiment_file_defines_and_trains_its_own_mixer(tmp_path):
    """A mixer and a beta rule registered by an experiment file outside palimpsa_jax/, trained
    with the launcher (its own process)."""
    (tmp_path / "my_experiment.py").write_text(EXPERIMENT)
    result = command("palimpsa_jax.commands.train", f"--config={tmp_path / 'my_experiment.py'}",
                     f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    final = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert np.isfinite(final["train/loss"]) and final["step"] == 4
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["mixers"] == ["constant_beta_deltanet", "palimpsa_d"]


def test_unknown_mixers_and_beta_rules_are_errors_naming_them():
    with pytest.raises(ValueError, match="mixers: mixer 'lstm' is not registered"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, mixers=("lstm",))
    with pytest.raises(ValueError, match="mixers: 'rule_gru' names no rule"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, mixers=("rule_gru",))
    with pytest.raises(ValueError, match="beta_rule 'nowhere:thing' cannot be imported"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, beta_rule="nowhere:thing")


def _relaxed_palimpsa(post, x):
    """Palimpsa whose forgetting relaxes the mean toward 0.5 (a prior mean)."""
    alpha = jnp.exp(x.log_alpha)
    importance = alpha * post.importance + (1 - alpha) * x.prior + jnp.outer(x.beta, x.k**2)
    evidence = (alpha * post.importance * post.mu + (1 - alpha) * x.prior * 0.5
                + jnp.outer(x.beta * x.v, x.k))
    return rules.Posterior(evidence / importance, importance)


def test_a_rule_defined_here_trains_as_a_layer(tmp_path, monkeypatch):
    relaxed = rules.Rule("relaxed_test", _relaxed_palimpsa, vector_beta=True,
                         init=rules.PALIMPSA.init)
    monkeypatch.setitem(rules.RULES, "relaxed_test", relaxed)
    config = tiny_config(steps=6, mixers=("rule_relaxed_test",), prior_family="head",
                         learn_prior=False)
    config.log.diagnostics_every_steps = 0
    config.checkpoint.every_steps = 0
    final = train_and_evaluate(config, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    loss = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(loss) == 2 and np.all(np.isfinite(loss)) and np.isfinite(final["eval/accuracy"])
    # the layer's memory is the rule: rules.run for every (sequence, head)
    model = CausalLM(ModelConfig(n_layers=1, **{**TINY, "mixers": ("rule_relaxed_test",),
                                                "prior_family": "head"}), rngs=nnx.Rngs(0))
    memory = model.blocks[0].mixer.memory
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 7, 2, 8)).astype(np.float32) for _ in range(3))
    beta = rng.uniform(0.1, 1, size=(2, 7, 2, 8)).astype(np.float32)
    log_alpha = -rng.uniform(0.01, 0.5, size=(2, 7, 2)).astype(np.float32)
    o, _ = memory(q, k, v, beta, log_alpha, scale=0.3)
    for b in range(2):
        for h in range(2):
            expected, _ = rules.run(relaxed, q[b, :, h], k[b, :, h], v[b, :, h], beta[b, :, h],
                                    log_alpha[b, :, h], 1.0, scale=0.3)
            np.testing.assert_allclose(o[b, :, h], expected, rtol=1e-5, atol=1e-6)
