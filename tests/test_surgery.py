"""Metaplastic surgery (models.surgery, palimpsa-surgery) of a checkpoint saved by transformers' Mamba2ForCausalLM:
the windows it measures are the analytic ones, it converts the layers with the largest, it keeps
every backbone weight bitwise, and with beta forced to zero the converted model is the original
exactly (and transformers' model to 1e-4)."""
import json
import pathlib
import subprocess
import sys

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extras install the CPU build
import transformers
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from palimpsa_jax.analysis.run import load_run
from palimpsa_jax.data.text import write_corpus
from palimpsa_jax.models import CausalLM, ModelConfig
from palimpsa_jax.models.mamba2_import import export_mamba2
from palimpsa_jax.models.surgery import choose_layers, converted_config, layer_windows, probe_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ModelConfig(vocab_size=64, d_model=32, n_layers=4, mixers=("mamba2",), ssm_state=16,
                     ssm_head_dim=16, ssm_expand=2, mlp_hidden=0, backend="reference")
HEADS = 4
# dt_bias per layer: layers 1 and 3 forget least (small dt, alpha near 1), layer 0 most.
DT_BIAS = np.array([1.0, -4.0, 0.0, -3.0], np.float32)


def _source_model() -> CausalLM:
    """A random Mamba2 LM whose time steps do not depend on the token (the dt columns of in_proj
    are zero): dt = softplus(dt_bias) per head, so each layer's windows are known exactly."""
    model = CausalLM(SOURCE, rngs=nnx.Rngs(3))
    for layer, block in enumerate(model.blocks):
        mixer = block.mixer
        mixer.in_proj.kernel[...] = mixer.in_proj.kernel[...].at[:, -HEADS:].set(0.0)
        mixer.dt_bias[...] = DT_BIAS[layer] + 0.1 * jnp.arange(HEADS, dtype=jnp.float32)
    return model


def _analytic_windows(model) -> np.ndarray:
    windows = []
    for block in model.blocks:
        A = np.exp(np.asarray(block.mixer.A_log[...], np.float64))
        dt = np.log1p(np.exp(np.asarray(block.mixer.dt_bias[...], np.float64)))
        windows.append(np.median(-1.0 / np.expm1(-A * dt)))
    return np.array(windows)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(model, a directory that transformers' Mamba2ForCausalLM saved it in, a corpus file of 3
    documents): the source of surgery is a checkpoint as transformers writes it."""
    root = tmp_path_factory.mktemp("surgery")
    model = _source_model()
    hf = transformers.Mamba2ForCausalLM.from_pretrained(export_mamba2(model, root / "ours")).float().eval()
    hf.save_pretrained(root / "pretrained")
    directory = root / "pretrained"
    rng = np.random.default_rng(0)
    documents = [rng.integers(1, SOURCE.vocab_size, n).tolist() for n in (50, 70, 40)]
    corpus = write_corpus(root / "corpus.npy", documents, eos_id=0)
    return model, directory, corpus


def _surgery(source, workdir, corpus, layers: str, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "palimpsa_jax.commands.surgery", "--from", str(source), "--workdir", str(workdir),
         "--layers", layers, "--probe", str(corpus), "--probe_rows", "3", "--config.data.seq_len=32",
         f"--config.data.path={corpus}", "--config.batch_size=2", "--config.eval.batch_size=2",
         "--config.model.dtype=float32", "--config.model.backend=reference", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(tokens)))


def _flat(model) -> dict:
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_windows_are_the_analytic_medians(pretrained):
    model, _, corpus = pretrained
    rows = probe_rows(corpus, eos_id=0, seq_len=32, rows=3)
    np.testing.assert_allclose(layer_windows(model, rows, batch_size=2), _analytic_windows(model), rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(windows=hnp.arrays(np.float64, st.integers(1, 12), elements=st.floats(1.0, 1e4)), data=st.data())
def test_weakest_are_the_largest_windows_of_the_mamba2_layers(windows, data):
    n = len(windows)
    mixers = tuple(data.draw(st.lists(st.sampled_from(["mamba2", "attention"]), min_size=n, max_size=n)))
    convertible = [i for i in range(n) if mixers[i] == "mamba2"]
    if not convertible:
        with pytest.raises(ValueError, match="layers: weakest:1"):
            choose_layers("weakest:1", windows, mixers)
        return
    count = data.draw(st.integers(1, len(convertible)))
    chosen = choose_layers(f"weakest:{count}", windows, mixers)
    assert len(chosen) == count and list(chosen) == sorted(chosen) and set(chosen) <= set(convertible)
    rest = set(convertible) - set(chosen)
    assert all(windows[i] >= windows[j] for i in chosen for j in rest)
    assert choose_layers("all", windows, mixers) == tuple(convertible)
    assert choose_layers("none", windows, mixers) == ()


def test_explicit_layers_and_errors_name_the_argument():
    windows, mixers = np.ones(4), ("mamba2", "attention", "mamba2", "mamba2")
    assert choose_layers("3,0", windows, mixers) == (0, 3)
    for selection, message in (("1", r"\[1\] are not mamba2"), ("0,9", r"\[9\]"), ("weakest:4", "1 to 3"),
                               ("weakest:0", "1 to 3"), ("half", "weakest:K, all, none")):
        with pytest.raises(ValueError, match=f"layers.*{message}|{message}"):
            choose_layers(selection, windows, mixers)


def test_converted_config_lists_every_layer_and_guards_metaplasticity():
    config = converted_config(SOURCE.replace(metaplasticity=False), (0, 2), beta_rank=8, dtype="bfloat16")
    assert config.layer_mixers == ("palimpsa_m", "mamba2", "palimpsa_m", "mamba2")
    assert config.metaplasticity and config.beta_rank == 8 and config.dtype == "bfloat16"
    assert config.replace(mixers=SOURCE.mixers, metaplasticity=False, beta_rank=SOURCE.beta_rank,
                          dtype=SOURCE.dtype) == SOURCE.replace(metaplasticity=False)
    hybrid = SOURCE.replace(mixers=("palimpsa_d", "mamba2"), metaplasticity=False)
    with pytest.raises(ValueError, match=r"metaplasticity=False and \['palimpsa_d'\] layers"):
        converted_config(hybrid, (1,))
    with pytest.raises(ValueError, match=r"model: \['d_model'\] are fixed"):
        converted_config(SOURCE, (1,), d_model=64)
    with pytest.raises(ValueError, match="model.metaplasticity must be True"):
        converted_config(SOURCE, (1,), metaplasticity=False)


def test_surgery_keeps_the_backbone_and_without_beta_is_the_original(pretrained, tmp_path):
    model, directory, corpus = pretrained
    result = _surgery(directory, tmp_path / "meta", corpus, "weakest:2")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "meta" / "surgery.json").read_text())
    assert record["layers"] == [1, 3]                       # the two largest windows
    np.testing.assert_allclose(record["windows"], _analytic_windows(model), rtol=1e-5)
    run = load_run(tmp_path / "meta")
    assert run.step == 0
    assert run.model.config.layer_mixers == ("mamba2", "palimpsa_m", "mamba2", "palimpsa_m")
    original, converted = _flat(model), _flat(run.model)
    for path, value in original.items():
        np.testing.assert_array_equal(converted[path], value, err_msg=str(path))
    added = sorted(".".join(map(str, path)) for path in set(converted) - set(original))
    assert added == [f"blocks.{i}.mixer.beta.{name}" for i in (1, 3)
                     for name in ("W_b1.kernel", "W_b2.kernel", "b_scale")]
    tokens = np.random.default_rng(1).integers(0, SOURCE.vocab_size, (2, 29))
    reference = _logits(model, tokens)
    assert np.abs(_logits(run.model, tokens) - reference).max() > 0     # the fresh beta > 0 acts
    for i in record["layers"]:                              # softplus(-inf) = 0: beta = 0
        run.model.blocks[i].mixer.beta.b_scale[...] = jnp.full((HEADS,), -jnp.inf)
    np.testing.assert_array_equal(_logits(run.model, tokens), reference)
    hf = transformers.Mamba2ForCausalLM.from_pretrained(directory).float().eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(reference - theirs).max() < 1e-4 * np.abs(theirs).max()     # and transformers' model


def test_converted_run_fine_tunes_and_a_run_converts_again(pretrained, tmp_path):
    """The control (--layers none) is the original model; palimpsa-train --resume fine-tunes it;
    a run directory is a source too."""
    model, directory, corpus = pretrained
    result = _surgery(directory, tmp_path / "control", corpus, "none", "--config.optim.warmup_steps=1")
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = np.random.default_rng(2).integers(0, SOURCE.vocab_size, (1, 17))
    np.testing.assert_array_equal(_logits(load_run(tmp_path / "control").model, tokens), _logits(model, tokens))
    train = subprocess.run(
        [sys.executable, "-m", "palimpsa_jax.commands.train", "--config", str(tmp_path / "control" / "experiment.py"),
         "--workdir", str(tmp_path / "control"), "--resume", "--config.train.steps=2",
         "--config.log.progress=False"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert load_run(tmp_path / "control").step == 2
    result = _surgery(tmp_path / "control", tmp_path / "again", corpus, "0,2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_run(tmp_path / "again").model.config.layer_mixers == ("palimpsa_m", "mamba2", "palimpsa_m", "mamba2")


def test_errors_name_the_culprit(pretrained, tmp_path):
    _, directory, corpus = pretrained
    result = _surgery(directory, tmp_path / "x", corpus, "weakest:5")
    assert result.returncode == 2 and "layers: weakest:5 needs 1 to 4" in result.stderr
    assert not (tmp_path / "x").exists()
    result = _surgery(directory, tmp_path / "w", corpus, "half")
    assert result.returncode == 2 and "layers must be weakest:K, all, none" in result.stderr
    result = _surgery(directory, tmp_path / "y", corpus, "all", "--config.model.metaplasticity=False")
    assert result.returncode == 1 and "--config.model.metaplasticity: unknown config key" in result.stderr
    result = _surgery(directory, tmp_path / "z", corpus, "all", "--probe_rows", "99")
    assert result.returncode == 2 and "probe_rows: the probe corpus holds" in result.stderr
