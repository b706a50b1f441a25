"""palimpsa-generate on a tiny trained text run: its text is `generate`'s, decoded and cut at the
first eos; it reports the speed; bad flags end it with a message naming the flag."""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm_run import shared_text_run

from palimpsa_jax.analysis.run import load_run
from palimpsa_jax.data.tokenizer import run_tokenizer
from palimpsa_jax.models.generate import generate, until_eos

# the module (palimpsa_jax.models exports its function `generate` under the same name)
generation = importlib.import_module("palimpsa_jax.models.generate")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return shared_text_run(tmp_path_factory)


@pytest.fixture(scope="module")
def run(run_dir):
    """The run's model and tokenizer."""
    return load_run(run_dir).model, run_tokenizer(run_dir)


def command(*args) -> subprocess.CompletedProcess:
    """The command's run, stdout and stderr decoded without newline translation (texts of the
    tiny model hold any byte, "\r" too)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run([sys.executable, "-m", "palimpsa_jax.commands.generate", *args], cwd=ROOT,
                            env=env, capture_output=True, timeout=600)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(),
                                       result.stderr.decode())


def samples(stdout: str) -> list[str]:
    """The texts of the command's `=== sample i of n ===` sections."""
    sections = re.split(r"^=== (.*) ===\n", stdout, flags=re.M)[1:]
    return [text[:-1] for title, text in zip(sections[::2], sections[1::2]) if title.startswith("sample")]


@pytest.mark.parametrize("durations,decode", [((0.5, 0.5), False), ((0.5, 0.8), True)])
def test_throughput_reports_decode_only_when_it_was_measured(monkeypatch, durations, decode):
    """throughput's decode is the difference of the medians of two timed programs; when the whole
    generation takes no longer than the prefill, the decode is left out rather than clipped.
    Simulated clock: every call of the prefill (1 new token) and of the whole generation lasts
    durations[0] and durations[1] seconds."""
    clock = [0.0]
    monkeypatch.setattr(generation, "generate",
                        lambda model, prompt, new_tokens, **_: clock.__setitem__(
                            0, clock[0] + durations[new_tokens > 1]))
    monkeypatch.setattr(generation.time, "perf_counter", lambda: clock[0])
    speed = generation.throughput(None, jnp.zeros((2, 8), jnp.int32), 4, repeats=3)
    assert np.isclose(speed["prefill_s"], durations[0])
    assert np.isclose(speed["prefill_tokens_per_s"], 16 / durations[0])
    assert np.isclose(speed["generate_s"], durations[1])
    assert ("decode_s_per_step" in speed) == decode
    if decode:
        assert np.isclose(speed["decode_s_per_step"], 0.1) and np.isclose(speed["decode_tokens_per_s"], 20)
    with pytest.raises(ValueError, match="repeats"):
        generation.throughput(None, jnp.zeros((2, 8), jnp.int32), 4, repeats=0)


def test_until_eos():
    assert until_eos(np.array([5, 3, 0, 7, 0]), 0) == [5, 3]
    assert until_eos([5, 3], 0) == [5, 3] and until_eos([0, 1], 0) == []


def test_greedy_text_is_generates_cut_at_eos_and_speed_is_reported(run, run_dir, tmp_path):
    """In a copy of the run whose eos is a token of the greedy continuation (config.json's
    data.eos_id, which the run's tokenizer takes), the text stops before that token's first
    occurrence. 256 new tokens, so that the decode steps take measurably longer than the prefill
    (about 15 ms against 6 on a CPU)."""
    model, tokenizer = run
    ids = tokenizer.encode(PROMPT)
    with jax.enable_x64(False):                      # as in the command
        new = np.asarray(generate(model, jnp.tile(jnp.asarray(ids), (2, 1)), 256, temperature=0.0))
    eos = int(new[0, 6])
    first = new[0].tolist().index(eos)
    copy = pathlib.Path(shutil.copytree(run_dir, tmp_path / "run"))
    config = json.loads((copy / "config.json").read_text())
    config["data"]["eos_id"] = eos
    (copy / "config.json").write_text(json.dumps(config))
    result = command(f"--workdir={copy}", f"--prompt={PROMPT}", "--temperature=0", "--max_new_tokens=256",
                     "--num_samples=2")
    assert result.returncode == 0, result.stderr[-3000:]
    head = tokenizer.decode(ids)
    text = PROMPT + tokenizer.decode(ids + new[0, :first].tolist())[len(head):]
    assert samples(result.stdout) == [text, text]
    assert len(text) < len(PROMPT + tokenizer.decode(ids + new[0].tolist())[len(head):])
    assert re.search(r"^prefill: \d+ tokens x 2 in [\d.]+ ms, \d+ tokens/s$", result.stdout, re.M)
    assert re.search(r"^decode: [\d.]+ ms per step of 2 tokens, \d+ tokens/s$", result.stdout, re.M)


@pytest.mark.parametrize("args, flag", [
    (["--workdir={run}", "--prompt=x", "--temperature=-0.5"], "--temperature"),
    (["--workdir={run}", "--prompt="], "--prompt"),
    (["--workdir=/nonexistent/run", "--prompt=x"], "--workdir"),
])
def test_bad_flags_name_the_flag(run_dir, args, flag):
    result = command(*(arg.format(run=run_dir) for arg in args))
    assert result.returncode != 0 and flag in result.stderr and "Traceback" not in result.stderr
