"""Long-context evaluation on a tiny trained text run: the loss by position is the direct
per-document computation, bucketed; passkey prompts are built as specified and scored by greedy
retrieval; palimpsa-long-context writes its tables and figures."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from lm_run import shared_text_run

from palimpsa_jax.analysis.run import load_run
from palimpsa_jax.data import Documents
from palimpsa_jax.data.tokenizer import run_tokenizer
from palimpsa_jax.evaluation import long_context as lc
from palimpsa_jax.models.generate import generate

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return shared_text_run(tmp_path_factory)


@pytest.fixture(scope="module")
def run(run_dir):
    """The run's model, tokenizer and held-out documents."""
    loaded = load_run(run_dir)
    return loaded.model, run_tokenizer(run_dir), Documents(loaded.config.data.test_path,
                                                           loaded.config.data.eos_id)


forward = nnx.jit(lambda model, tokens: model(tokens)[0])


def direct_losses(model, docs: list[np.ndarray], length: int) -> list[np.ndarray]:
    """Per document, -log p(doc[t] | doc[:t]) for t = 1..min(length, n - 1), float64: one forward
    of all the windows at once, padded with token 7 (the function pads with 0, in batches)."""
    windows = np.full((len(docs), length), 7, np.int32)
    for row, doc in enumerate(docs):
        windows[row, :min(length, len(doc))] = doc[:length]
    logits = forward(model, windows)
    log_probs = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
    return [-log_probs[row, np.arange(n), doc[1:n + 1]]
            for row, doc in enumerate(docs) for n in [min(length, len(doc) - 1)]]


@pytest.mark.parametrize("buckets", [None, [0, 3, 10, 20]])
def test_loss_by_position_is_the_direct_loss_bucketed(run, buckets):
    """20 documents of 10-39 tokens, read up to 32: some cut, some shorter; batches of 6 (the
    last one padded); default edges, and edges that stop before length (the `Documents` given
    as they are)."""
    model, _, documents = run
    docs = lc.long_documents(documents)
    table = lc.loss_by_position(model, documents if buckets else docs, length=32, batch_size=6,
                                buckets=buckets)
    edges = lc.default_edges(32) if buckets is None else buckets
    assert edges == ([0, 1, 2, 4, 8, 16, 32] if buckets is None else buckets)
    assert table.first.tolist() == [e + 1 for e in edges[:-1]] and table.last.tolist() == edges[1:]
    per_doc = direct_losses(model, docs, 32)
    for k, (first, last) in enumerate(zip(table.first, table.last)):
        losses = np.concatenate([d[first - 1:last] for d in per_doc])
        assert table.count[k] == len(losses)
        assert table.documents[k] == sum(len(d) >= first for d in per_doc)
        np.testing.assert_allclose(table.mean_loss[k], losses.mean(), rtol=1e-5)
    if buckets is None:
        assert table.count.sum() == sum(min(32, len(doc) - 1) for doc in docs)
        assert 0 < table.documents[-1] < len(docs)       # a few documents reach the last bucket


def test_long_documents_and_bad_arguments(run):
    model, _, documents = run
    lengths = documents.ends - documents.starts
    long = lc.long_documents(documents, min_length=30, count=3)
    assert [len(d) for d in long] == lengths[lengths >= 30][:3].tolist()
    np.testing.assert_array_equal(long[0], documents[int(np.flatnonzero(lengths >= 30)[0])]["tokens"])
    for kwargs, name in ((dict(length=0), "length"), (dict(length=8, buckets=[0, 4, 9]), "buckets"),
                         (dict(length=8, buckets=[2, 2, 4]), "buckets"), (dict(length=8, batch_size=0), "batch_size")):
        with pytest.raises(ValueError, match=name):
            lc.loss_by_position(model, long, **kwargs)
    table = lc.PositionLoss(*map(np.array, ([1, 3], [2, 4], [2.5, np.nan], [4, 0], [2, 0])))
    assert table.rows()[1]["mean_loss"] is None
    np.testing.assert_array_equal(lc.PositionLoss.from_rows(json.loads(json.dumps(table.rows()))).mean_loss,
                                  table.mean_loss)


@pytest.mark.parametrize("name", list(lc.HAYSTACKS))
@pytest.mark.parametrize("length", [70, 101, 163])
def test_passkey_prompt(run, length, name):
    """Exactly `length` tokens: filler, the needle at the piece boundary nearest the depth (before
    a whole piece, the one cut at its start first), filler, the question; the key's digits are
    tokens of the needle."""
    _, tokenizer, _ = run
    haystack = lc.HAYSTACKS[name]
    piece = lambda text: lc._piece(tokenizer, text, haystack.separator)
    needle, question = piece(haystack.needle.format(key="40571")), piece(haystack.question)
    longest = max(len(piece(s)) for s in haystack.filler)
    marker = haystack.needle.split("{key}")[0].strip()
    for depth in (0, 0.3, 0.5, 1):
        prompt = lc.passkey_prompt(tokenizer, length, depth, "40571", haystack=haystack)
        tokens, at = prompt.tokens.tolist(), prompt.needle_start
        assert len(tokens) == length and prompt.filler_tokens == length - len(needle) - len(question)
        assert tokens[at:at + len(needle)] == needle and tokens[-len(question):] == question
        assert abs(at - depth * prompt.filler_tokens) <= longest
        before, after = tokenizer.decode(tokens[:at]), tokenizer.decode(tokens[at + len(needle):])
        last = before.split(haystack.separator)[-1]         # the needle sits between pieces,
        assert before == "" or any(s.endswith(last) for s in haystack.filler)
        assert any(after.startswith(haystack.separator + s)  # before a whole one
                   for s in (*haystack.filler, haystack.question))
        filler_text = before + after.removesuffix(haystack.separator + haystack.question)
        assert marker not in filler_text
        assert set(haystack.separator.join(haystack.filler) + haystack.separator) >= set(filler_text)
        key = lc._piece(tokenizer, "40571")
        assert any(tokens[i:i + len(key)] == key for i in range(at, at + len(needle)))
        assert lc.answer(tokenizer, key) == "40571"
    assert lc.passkey_prompt(tokenizer, length, 0, "40571", haystack=haystack).needle_start <= longest
    assert lc.passkey_prompt(tokenizer, length, 1, "40571", haystack=haystack).needle_start == prompt.filler_tokens
    with pytest.raises(ValueError, match="length"):
        lc.passkey_prompt(tokenizer, len(needle) + len(question) - 1, 0.5, "40571", haystack=haystack)


@pytest.mark.parametrize("depth", [0, 0.4, 1])
def test_python_passkey_prompt_is_python_whose_assert_holds_for_the_key(run, depth):
    """The python haystack's prompt, from its first whole line, followed by " key" is a Python
    module that assigns the key once and asserts it equals the key; another key fails."""
    _, tokenizer, _ = run
    haystack = lc.HAYSTACKS["python"]
    text = tokenizer.decode(lc.passkey_prompt(tokenizer, 120, depth, "40571", haystack=haystack).tokens)
    module = text[text.index("\n") + 1:] + " 40571"       # the filler's first line may be cut
    namespace = {"print": lambda *args: None}
    exec(compile(module, "<passkey>", "exec"), namespace)
    assert namespace["PASS_KEY"] == 40571 and module.count("PASS_KEY") == 2
    with pytest.raises(AssertionError):
        exec(compile(module.removesuffix("40571") + "40572", "<passkey>", "exec"), {"print": lambda *a: None})


def oracle(tokenizer, *, wrong: bool = False, first_half_only: bool = False):
    """A continue_fn that reads the key off the prompt: the key itself, its digits each plus one
    (mod 10) if wrong, or nothing when first_half_only and the needle is in the prompt's second
    half (by characters)."""
    def continue_fn(prompts, new_tokens):
        out = np.full((len(prompts), new_tokens), tokenizer.eos_id)
        for row, prompt in enumerate(prompts):
            text = tokenizer.decode(prompt)
            match = re.search(r"pass key is (\d+)", text)
            key = "".join(str((int(c) + 1) % 10) for c in match[1]) if wrong else match[1]
            if not (first_half_only and match.start() > len(text) / 2):
                ids = lc._piece(tokenizer, key)
                out[row, :len(ids)] = ids
        return out
    return continue_fn


def test_passkey_accuracy_of_stubs(run, tmp_path):
    """An oracle scores 1 everywhere, wrong digits 0; one right in the first half only gives the
    matrix of where the needles are (rows: depths, columns: lengths); the heatmap is a PNG."""
    _, tokenizer, _ = run
    grid = dict(lengths=[70, 130], depths=[0, 0.5, 0.9], trials=2, batch_size=4)
    right = lc.passkey_accuracy(oracle(tokenizer), tokenizer, **grid)
    assert right.accuracy.shape == (3, 2) and (right.accuracy == 1).all()
    assert (lc.passkey_accuracy(oracle(tokenizer, wrong=True), tokenizer, **grid).accuracy == 0).all()
    half = lc.passkey_accuracy(oracle(tokenizer, first_half_only=True), tokenizer, **grid)
    where = [[float(tokenizer.decode(p.tokens).index("pass key") <= len(tokenizer.decode(p.tokens)) / 2)
              for p in (lc.passkey_prompt(tokenizer, length, depth, "12345") for length in grid["lengths"])]
             for depth in grid["depths"]]
    assert half.accuracy.tolist() == where and 0 < np.mean(where) < 1
    for name, result in (("right", right), ("half", half)):
        lc.plot_passkey(result, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG


def test_passkey_accuracy_of_the_model_is_its_greedy_retrieval(run):
    model, tokenizer, _ = run
    lengths, depths, trials = [70], [0.0, 1.0], 2
    result = lc.passkey_accuracy(model, tokenizer, lengths=lengths, depths=depths, trials=trials, seed=3)
    keys = np.random.default_rng(3).integers(10_000, 100_000, size=(1, 2, 2))
    new_tokens = 1 + max(len(lc._piece(tokenizer, str(k))) for k in keys.flat)
    for l, length in enumerate(lengths):
        prompts = [lc.passkey_prompt(tokenizer, length, depth, str(key)) for depth, row in zip(depths, keys[l])
                   for key in row]
        new = generate(model, np.stack([p.tokens for p in prompts]), new_tokens, temperature=0.0)
        right = [lc.answer(tokenizer, c) == p.key for p, c in zip(prompts, new)]
        assert result.accuracy[:, l].tolist() == np.reshape(right, (2, 2)).mean(1).tolist()


def test_command_writes_tables_and_figures(run, run_dir, tmp_path):
    """One run evaluated and a second one's saved table in the plot (--compare)."""
    model, _, documents = run
    other = tmp_path / "other"
    (other / "long_context").mkdir(parents=True)
    shutil.copy(run_dir / "config.json", other)
    saved = lc.loss_by_position(model, lc.long_documents(documents, count=8), length=32, batch_size=6)
    (other / "long_context" / "loss_by_position.json").write_text(json.dumps({"step": 1, "buckets": saved.rows()}))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "palimpsa_jax.commands.long_context", f"--workdir={run_dir}", f"--compare={other}",
         "--length=32", "--documents=8", "--batch_size=6", "--passkey_lengths=70", "--passkey_depths=0,1",
         "--passkey_haystacks=prose,python", "--trials=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_dir / "long_context"
    written = json.loads((out / "loss_by_position.json").read_text())
    assert written["documents"] == 8 and written["length"] == 32
    table = lc.PositionLoss.from_rows(written["buckets"])
    np.testing.assert_array_equal(table.count, saved.count)
    np.testing.assert_allclose(table.mean_loss, saved.mean_loss, rtol=1e-5)
    assert (out / "loss_by_position.csv").read_text().splitlines()[0] == "first,last,mean_loss,count,documents"
    passkey = json.loads((out / "passkey_prose.json").read_text())
    expected = lc.passkey_accuracy(model, run[1], lengths=[70], depths=[0, 1], trials=2)
    assert passkey["accuracy"] == expected.accuracy.tolist() and passkey["haystack"] == "prose"
    python = json.loads((out / "passkey_python.json").read_text())
    expected = lc.passkey_accuracy(model, run[1], lengths=[70], depths=[0, 1], trials=2,
                                   haystack=lc.HAYSTACKS["python"])
    assert python["accuracy"] == expected.accuracy.tolist() and python["haystack"] == "python"
    for name in ("loss_by_position.png", "passkey_prose.png", "passkey_python.png"):
        assert (out / name).read_bytes()[:8] == PNG
