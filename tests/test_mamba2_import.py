"""Pretrained Mamba2 in and out (models.mamba2_import, commands.convert) against transformers'
Mamba2ForCausalLM (its PyTorch path, float32 on CPU): same logits, same greedy continuation,
exact export round trips, the state-spaces layout, and errors that name the culprit."""
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy
import torch  # the test extras install the CPU build
import transformers
from flax import nnx

from palimpsa_jax.analysis.run import load_run
from palimpsa_jax.data.text import write_corpus
from palimpsa_jax.data.tokenizer import run_tokenizer
from palimpsa_jax.models import generate
from palimpsa_jax.models.mamba2_import import (
    CheckpointFormatError,
    export_mamba2,
    load_mamba2,
    mamba2_model,
)

VOCAB, PADDED = 100, 112        # mamba_ssm pads 100 to a multiple of 16
CHUNK = 16                      # both sides; the test lengths are not multiples of it
CASES = {"groups1-tied-safetensors": dict(n_groups=1, tied=True, safe=True),
         "groups2-untied-bin": dict(n_groups=2, tied=False, safe=False)}


def _hf_model(n_groups: int, tied: bool):
    """A random float32 Mamba2ForCausalLM: d_model 32, 2 layers, 4 heads of 16, state 16; every
    parameter (norms, A_log, D, dt_bias too) perturbed off its initial value."""
    torch.manual_seed(n_groups)
    config = transformers.Mamba2Config(
        vocab_size=PADDED, hidden_size=32, num_hidden_layers=2, state_size=16, n_groups=n_groups,
        head_dim=16, num_heads=4, expand=2, conv_kernel=4, chunk_size=CHUNK, tie_word_embeddings=tied,
        use_conv_bias=True, use_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Mamba2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    """Our model's logits, jitted (compiling the whole forward once beats op-by-op on CPU)."""
    return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(tokens)))


def _flat(params) -> dict:
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(params)}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, HF model, its save_pretrained directory)."""
    case = CASES[request.param]
    model = _hf_model(case["n_groups"], case["tied"])
    directory = tmp_path_factory.mktemp(request.param)
    if case["safe"]:
        model.save_pretrained(directory)
    else:     # transformers 5 saves safetensors only: the older pytorch_model.bin by hand
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return case, model, directory


TOKENS = np.random.default_rng(0).integers(0, PADDED, (2, 37))


def test_logits_equal_transformers(checkpoint):
    case, hf, directory = checkpoint
    ours = mamba2_model(directory, backend="xla", chunk_size=CHUNK)
    assert ours.config.ssm_groups == case["n_groups"] and ours.config.tie_embeddings == case["tied"]
    assert ours.config.vocab_size == PADDED and (ours.head is None) == case["tied"]
    logits, ref = _logits(ours, TOKENS), _hf_logits(hf, TOKENS)
    assert logits.dtype == np.float32
    assert np.abs(logits - ref).max() < 1e-4 * np.abs(ref).max()


def test_greedy_continuation_equals_transformers(checkpoint):
    _, hf, directory = checkpoint
    ours = mamba2_model(directory, backend="xla", chunk_size=CHUNK)
    prompt = TOKENS[:, :21]
    new = generate(ours, jnp.asarray(prompt), 12, temperature=0.0)
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    np.testing.assert_array_equal(np.asarray(new), ref[:, prompt.shape[1]:].numpy())


def test_export_round_trip(checkpoint, tmp_path):
    """Export, re-import: the same config and bit-identical parameters; transformers reads the
    export to the same logits as the original."""
    _, hf, directory = checkpoint
    config, params = load_mamba2(directory)
    export_mamba2(mamba2_model(directory, chunk_size=CHUNK), tmp_path)
    config2, params2 = load_mamba2(tmp_path)
    assert config2 == config
    first, second = _flat(params), _flat(params2)
    assert first.keys() == second.keys()
    for path in first:
        np.testing.assert_array_equal(first[path], second[path], err_msg=str(path))
    reloaded = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path).float().eval()
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf, TOKENS))


def _state_spaces(hf_directory: pathlib.Path, target: pathlib.Path, case: dict) -> pathlib.Path:
    """The same weights in mamba_ssm's layout: its config.json (unpadded vocabulary, ssm_cfg),
    backbone.embedding instead of backbone.embeddings, lm_head.weight also when tied."""
    config, params = load_mamba2(hf_directory)
    export_mamba2(mamba2_model(hf_directory), target)
    weights = safetensors_numpy.load_file(target / "model.safetensors")
    weights["backbone.embedding.weight"] = weights.pop("backbone.embeddings.weight")
    if case["tied"]:
        weights["lm_head.weight"] = weights["backbone.embedding.weight"]
    safetensors_numpy.save_file(weights, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps({
        "d_model": 32, "d_intermediate": 0, "n_layer": 2, "vocab_size": VOCAB,
        "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": case["n_groups"], "expand": 2,
                    "d_conv": 4},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": case["tied"]}))
    return target


def test_state_spaces_layout_imports_to_the_same_parameters(checkpoint, tmp_path):
    case, _, directory = checkpoint
    config, params = load_mamba2(directory)
    config2, params2 = load_mamba2(_state_spaces(directory, tmp_path, case))
    assert config2 == config
    first, second = _flat(params), _flat(params2)
    assert first.keys() == second.keys()
    for path in first:
        np.testing.assert_array_equal(first[path], second[path], err_msg=str(path))


def _rewrite(directory: pathlib.Path, target: pathlib.Path, *, config=None, drop=(), add=None) -> pathlib.Path:
    """A copy of a safetensors checkpoint with config.json fields changed and weights dropped or added."""
    weights = safetensors_numpy.load_file(directory / "model.safetensors")
    for name in drop:
        del weights[name]
    weights.update(add or {})
    safetensors_numpy.save_file(weights, target / "model.safetensors")
    raw = json.loads((directory / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, **(config or {})}))
    return target


@pytest.fixture(scope="module")
def safetensors_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad")
    _hf_model(1, tied=False).save_pretrained(directory)
    return directory


def test_missing_and_unexpected_weights_are_named(safetensors_checkpoint, tmp_path):
    missing = _rewrite(safetensors_checkpoint, tmp_path, drop=["backbone.layers.1.mixer.D"])
    with pytest.raises(CheckpointFormatError, match=r"missing weights \['backbone.layers.1.mixer.D'\]"):
        load_mamba2(missing)
    extra = _rewrite(safetensors_checkpoint, tmp_path, add={"backbone.layers.0.mixer.extra": np.ones(3, np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"unexpected weights \['backbone.layers.0.mixer.extra'\]"):
        load_mamba2(extra)
    wrong = _rewrite(safetensors_checkpoint, tmp_path, add={"backbone.layers.0.mixer.D": np.ones(5, np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"backbone.layers.0.mixer.D has shape \(5,\), expected \(4,\)"):
        load_mamba2(wrong)


def test_unknown_layout_and_unsupported_fields_are_named(safetensors_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(CheckpointFormatError, match="model_type 'llama'"):
        load_mamba2(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 32, "n_layer": 2, "vocab_size": 100,
                                                      "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [1]}))
    with pytest.raises(CheckpointFormatError, match="attn_layer_idx"):
        load_mamba2(tmp_path)
    limited = _rewrite(safetensors_checkpoint, tmp_path, config={"time_step_limit": [0.0, 0.1]})
    with pytest.raises(CheckpointFormatError, match="time_step_limit"):
        load_mamba2(limited)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text((safetensors_checkpoint / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        load_mamba2(tmp_path)


def _word_tokenizer(path: pathlib.Path) -> pathlib.Path:
    """A tokenizer.json of VOCAB whole words, <|endoftext|> = 0."""
    import tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("checkpoint", ["groups1-tied-safetensors"], indirect=True)
def test_convert_command_writes_a_run_that_exports_back(checkpoint, tmp_path):
    """palimpsa-convert --from: a run at step 0 with the checkpoint's tokenizer, which load_run
    reads to transformers' logits; export_mamba2 of the run: the original weights bit for bit,
    the tokenizer and its end-of-document id."""
    _, hf, pretrained = checkpoint
    directory = shutil.copytree(pretrained, tmp_path / "pretrained")
    _word_tokenizer(directory / "tokenizer.json")
    corpus = write_corpus(tmp_path / "corpus.npy", [[1 + i % 90] * 40 for i in range(20)], eos_id=0)
    workdir, exported = tmp_path / "run", tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "palimpsa_jax.commands.convert", "--from", str(directory),
                    "--workdir", str(workdir), f"--config.data.path={corpus}", "--config.data.seq_len=32",
                    "--config.model.backend=xla", f"--config.model.chunk_size={CHUNK}"],
                   check=True, capture_output=True)
    run = load_run(workdir)
    assert run.step == 0 and run.config.model.vocab_size == PADDED and run.config.model.mixers == ("mamba2",)
    tokenizer = run_tokenizer(workdir)
    assert tokenizer.path == workdir / "tokenizer.json" and tokenizer.eos_id == run.config.data.eos_id == 0
    assert tokenizer.encode("w5 w7") == [5, 7]
    logits, ref = _logits(run.model, TOKENS), _hf_logits(hf, TOKENS)
    assert np.abs(logits - ref).max() < 1e-4 * np.abs(ref).max()
    export_mamba2(workdir, exported)
    original = safetensors_numpy.load_file(directory / "model.safetensors")
    again = safetensors_numpy.load_file(exported / "model.safetensors")
    assert original.keys() == again.keys()
    for name in original:
        np.testing.assert_array_equal(original[name], again[name], err_msg=name)
    assert (exported / "tokenizer.json").read_text() == (directory / "tokenizer.json").read_text()
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == 0


def test_x64_does_not_leak_into_the_parameters(checkpoint):
    """conftest enables jax_enable_x64; the imported parameters stay float32."""
    assert jax.config.jax_enable_x64
    _, params = load_mamba2(checkpoint[2])
    assert {v.dtype for v in _flat(params).values()} == {np.dtype(np.float32)}


def test_shards_and_bfloat16_read_as_the_single_float32_file(safetensors_checkpoint, tmp_path):
    """Sharded safetensors (with their index) give the same parameters; bfloat16 weights give
    their float32 values."""
    model = _hf_model(1, tied=False)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, params = load_mamba2(safetensors_checkpoint)
    _, sharded = load_mamba2(tmp_path / "sharded")
    for path, value in _flat(params).items():
        np.testing.assert_array_equal(value, _flat(sharded)[path], err_msg=str(path))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    raw = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["backbone.embeddings.weight"]["dtype"] == "BF16"
    _, half = load_mamba2(tmp_path / "bf16")
    embedding = model.backbone.embeddings.weight.detach().float().numpy()
    np.testing.assert_array_equal(_flat(half)[("embed", "embedding")], embedding)
