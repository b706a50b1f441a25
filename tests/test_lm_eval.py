"""The lm-evaluation-harness model ("palimpsa", evaluation.harness) and its commands, on a tiny
trained run: scores through lm-eval's own tasks (local YAML and JSONL, no network) against
log-probabilities computed directly from one unpadded forward per sequence."""
import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from lm_run import sentences, shared_text_run

from palimpsa_jax.evaluation.harness import PalimpsaLM
from palimpsa_jax.models.generate import generate, until_eos

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LENGTH = 24          # short windows: truncation and several rolling windows per document
CHOICE_TASK = """\
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choice.jsonl
  cache_dir: {data}/cache
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PERPLEXITY_TASK = """\
task: tiny_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/documents.jsonl
  cache_dir: {data}/cache
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def offline():
    """No network for the datasets library (it reads its offline switch at import)."""
    import datasets.config

    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            patch.setenv(name, "1")
            patch.setattr(datasets.config, name, True)
        yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return shared_text_run(tmp_path_factory)


@pytest.fixture(scope="module")
def lm(run_dir):
    return PalimpsaLM(str(run_dir), batch_size=4, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A folder of the two task YAML files and their JSONL data; returns (folder, choice docs,
    documents). Contexts and documents are longer than max_length tokens (so every window the
    model sees has max_length + 1 tokens: one compiled reference forward)."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(3)
    words = " ".join(sentences(40, seed=5)).split()
    choice_docs = [{"context": " ".join(words[40 * i:40 * i + 30]), "label": int(rng.integers(3)),
                    "choices": [" ".join(words[40 * i + 30 + 3 * j:40 * i + 30 + 3 * j + k])
                                for j, k in enumerate(rng.integers(1, 4, size=3))]}
                   for i in range(6)]
    documents = [{"text": " ".join(words[300 + 50 * i:300 + 50 * i + n])} for i, n in enumerate((30, 45, 50))]
    for name, docs in (("choice", choice_docs), ("documents", documents)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_choice.yaml").write_text(CHOICE_TASK.format(data=folder))
    (folder / "tiny_perplexity.yaml").write_text(PERPLEXITY_TASK.format(data=folder))
    return folder, choice_docs, [d["text"] for d in documents]


# --- the direct computation ----------------------------------------------------------------

@functools.cache
def _forward(graphdef):
    """The logits (1, T, V) of tokens (1, T), jitted (compiled once per length T)."""
    return jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])


def direct(model, tokens: list[int], scored: int) -> tuple[float, bool]:
    """(sum of log p(token | the tokens before it) over the last `scored` tokens, float64;
    whether each is the argmax) from one forward of the unpadded sequence."""
    graphdef, state = nnx.split(model)
    logits = np.asarray(_forward(graphdef)(state, jnp.asarray([tokens[:-1]]))[0], np.float64)[-scored:]
    targets = np.asarray(tokens[1:])[-scored:]
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return float(logprobs[np.arange(scored), targets].sum()), bool((logits.argmax(-1) == targets).all())


def pair_loglikelihood(lm, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's causal split, then `direct`: the context's trailing spaces join the
    continuation; context + continuation is encoded and split after the context's own tokens
    (an empty context is the end-of-document token); the last max_length + 1 tokens are seen."""
    tokenizer = lm.tokenizer
    if context:
        spaces = len(context) - len(context.rstrip())
        context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
        prefix = tokenizer.encode(context)
        whole = tokenizer.encode(context + continuation)
        ids, scored = whole, len(whole) - len(prefix)
    else:
        cont = tokenizer.encode(continuation)
        ids, scored = [tokenizer.eos_id, *cont], len(cont)
    return direct(lm.run.model, ids[-(lm.max_length + 1):], scored)


def document_loglikelihood(lm, text: str) -> float:
    """Chunks of max_length tokens, each predicted from the max_length tokens before its end
    (from the end-of-document token on, at the start)."""
    tokens = lm.tokenizer.encode(text)
    padded, length = [lm.tokenizer.eos_id, *tokens], lm.max_length
    return sum(direct(lm.run.model, padded[max(0, end - length):end + 1], end - start)[0]
               for start in range(0, len(tokens), length)
               for end in [min(start + length, len(tokens))])


@pytest.fixture(scope="module")
def choice_lls(lm, tasks):
    """The direct log-likelihood of every choice of every multiple-choice doc."""
    return [np.array([pair_loglikelihood(lm, doc["context"], " " + c)[0] for c in doc["choices"]])
            for doc in tasks[1]]


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


# --- tests ----------------------------------------------------------------------------------

LONG = " ".join(sentences(3, seed=9))          # longer than max_length tokens
# 6 tokens each (an empty context is one token), then the last max_length + 1 of LONG's: two
# compiled reference forwards, the longer one shared with the tasks'
PAIRS = [("the cat sat on", " a mat"), ("the cat sat on ", "a mat"), ("", "the dog ran on a"),
         (LONG, " and then it was happy.")]


def test_loglikelihood_equals_the_unpadded_forward_batched_or_not(lm, run_dir):
    """Every pair (a trailing space, an empty context, longer than max_length) in a batch
    (padded rows and length) and one at a time; a context's trailing space is the
    continuation's."""
    batched = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    single = PalimpsaLM(str(run_dir), batch_size=1, max_length=MAX_LENGTH)
    assert len(lm.tok_encode(LONG)) > MAX_LENGTH
    for pair, (ll, greedy) in zip(PAIRS, batched):
        [(ll_single, greedy_single)] = single.loglikelihood(requests("loglikelihood", [pair]),
                                                            disable_tqdm=True)
        expected, expected_greedy = pair_loglikelihood(lm, *pair)
        assert ll == pytest.approx(ll_single, abs=1e-5) and greedy == greedy_single
        assert ll == pytest.approx(expected, rel=1e-5, abs=1e-5) and greedy == expected_greedy
    assert batched[0] == batched[1]


def test_simple_evaluate_scores_are_the_direct_ones(lm, tasks, choice_lls, offline):
    """Per example, lm-eval's requests score as the direct computation does: acc / acc_norm
    are the argmax of the direct log-likelihoods (acc_norm: per character of the choice); the
    perplexities are exp of the direct sums over the words and bytes."""
    folder, choice_docs, documents = tasks
    results = simple_evaluate(model=lm, tasks=["tiny_choice", "tiny_perplexity"],
                              task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    samples = sorted(results["samples"]["tiny_choice"], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(choice_docs)
    for sample, doc, lls in zip(samples, choice_docs, choice_lls):
        assert [tuple(a) for a in sample["arguments"]] == [(doc["context"], " " + c) for c in doc["choices"]]
        assert [ll for ll, _ in sample["filtered_resps"]] == pytest.approx(lls, rel=1e-5)
        assert sample["acc"] == float(np.argmax(lls) == doc["label"])
        assert sample["acc_norm"] == float(np.argmax(lls / [len(c) for c in doc["choices"]]) == doc["label"])
    assert results["results"]["tiny_choice"]["acc,none"] == np.mean([s["acc"] for s in samples])
    lls = [document_loglikelihood(lm, text) for text in documents]
    samples = sorted(results["samples"]["tiny_perplexity"], key=lambda sample: sample["doc_id"])
    assert [sample["filtered_resps"][0] for sample in samples] == pytest.approx(lls, rel=1e-5)
    total, perplexity = sum(lls), results["results"]["tiny_perplexity"]
    words = sum(len(re.split(r"\s+", text)) for text in documents)
    nbytes = sum(len(text.encode()) for text in documents)
    assert perplexity["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-5)
    assert perplexity["byte_perplexity,none"] == pytest.approx(math.exp(-total / nbytes), rel=1e-5)
    assert perplexity["bits_per_byte,none"] == pytest.approx(-total / nbytes / math.log(2), rel=1e-5)


def test_generate_until_is_greedy_generate_cut_at_the_first_stop_string(lm):
    """Two contexts, the second one left-truncated to max_length - max_gen_toks tokens (12,
    the first one's length: one batch of `generate`), then cut at stop strings."""
    contexts = ["the quick brown fox jumps over the lazy dog and then it", LONG]
    prompts = [lm.tokenizer.encode(context)[-(MAX_LENGTH - 12):] for context in contexts]
    new = generate(lm.run.model, jnp.asarray(prompts), 12, temperature=0.0)
    full = [lm.tokenizer.decode(ids + until_eos(row, lm.eot_token_id))[len(lm.tokenizer.decode(ids)):]
            for ids, row in zip(prompts, new)]
    assert len(prompts[0]) == 12 and all(len(text) > 8 for text in full)
    stops = [[full[0][3:6]], [full[1][5:8], full[1][2:4]]]      # two: the earlier one cuts
    args = [(c, {"until": [], "max_gen_toks": 12, "do_sample": False}) for c in contexts]
    args += [(c, {"until": stop, "max_gen_toks": 12}) for c, stop in zip(contexts, stops)]
    out = lm.generate_until(requests("generate_until", args), disable_tqdm=True)
    assert out[:2] == full
    assert out[2:] == [text[:min(text.find(s) for s in stop)] for text, stop in zip(full, stops)]
    assert all(len(text) < len(whole) for text, whole in zip(out[2:], full))


def test_eval_command_runs_tasks(lm, run_dir, tasks, choice_lls):
    """palimpsa-eval --tasks with --limit: its lm_eval_<step>.json holds the acc of the first
    examples; --config.<key> with --tasks is an error naming the key."""
    folder, choice_docs, _ = tasks
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "palimpsa_jax.commands.evaluate", f"--workdir={run_dir}",
               "--tasks=tiny_choice", f"--include_path={folder}", "--batch_size=4",
               f"--max_length={MAX_LENGTH}"]
    result = subprocess.run([*command, "--limit=3"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny_choice" in result.stdout
    saved = json.loads((run_dir / f"lm_eval_{lm.run.step}.json").read_text())
    expected = np.mean([np.argmax(lls) == doc["label"] for doc, lls in zip(choice_docs[:3], choice_lls)])
    assert saved["step"] == lm.run.step
    assert saved["results"]["tiny_choice"]["acc,none"] == pytest.approx(expected)
    bad = subprocess.run([*command, "--config.eval.batch_size=2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--config.eval.batch_size" in bad.stderr
