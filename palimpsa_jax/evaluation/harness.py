"""A trained run as an lm-evaluation-harness model, registered as "palimpsa".

    lm_eval.simple_evaluate(model="palimpsa", model_args={"workdir": "runs/X"}, tasks=["piqa"])

Requests are scored as lm-eval's Hugging Face model scores them (`TemplateLM`): a context and
its continuation are encoded together and split where the context's own encoding ends, with the
context's trailing spaces moved to the continuation; an empty context is the end-of-document
token; sequences longer than max_length + 1 tokens lose their left part. Documents scored whole
(perplexity) are cut into lm-eval's disjoint rolling windows of max_length tokens, the first
predicted from the end-of-document token.

Batches are right-padded to a power of two (at least 64 tokens, always batch_size rows), so the
jitted scorer compiles once per length bucket; the model is causal, so the padding leaves the
scores of the real tokens as an unpadded forward computes them. Generation left-pads prompts
as a first segment (segment ids 0 then 1: the recurrent state and the key-value cache start
afresh at the prompt) and decodes with the cache, one token a step.
"""
from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from palimpsa_jax.analysis.run import load_run
from palimpsa_jax.data.tokenizer import run_tokenizer
from palimpsa_jax.models.generate import generate, until_eos

MIN_BUCKET = 64
GENERATION_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def bucket(length: int) -> int:
    """The padded length of `length` tokens: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


@register_model("palimpsa")
class PalimpsaLM(TemplateLM):
    """The model of the run in `workdir` (its latest checkpoint, or `step`) with its tokenizer.

    batch_size: sequences per forward; max_length: the most tokens a forward sees (default the
    run's data.seq_len, its training length; recurrent mixers run at any length, attention's
    RoPE extrapolates past it); max_gen_toks: tokens generated when a request names no
    max_gen_toks; seed: of sampled generation. device and max_batch_size, which lm-eval's
    command line always passes, are unused: JAX runs on its first device, batches are fixed.
    """

    def __init__(self, workdir: str, step: int | None = None, batch_size: int | str = 1,
                 max_length: int | None = None, max_gen_toks: int = 256, seed: int = 0,
                 device: str | None = None, max_batch_size: int | None = None):
        super().__init__()
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer (there is no automatic batch "
                             f"size), got {batch_size!r}")
        run = load_run(workdir, None if step is None else int(step), devices=jax.devices()[:1])
        self.run, self.tokenizer = run, run_tokenizer(workdir)
        self.batch_size = int(batch_size)
        self._max_length = int(max_length or run.config.data.get("seq_len") or 0)
        if self._max_length < 1:
            raise ValueError(f"max_length must be a positive integer (run {workdir} has no "
                             f"data.seq_len to default to), got {max_length!r}")
        self.max_gen_toks = int(max_gen_toks)
        self._rng = jax.random.PRNGKey(int(seed))
        self._graphdef, self._state = nnx.split(run.model)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    # --- scoring -------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """requests: (key, context ids, continuation ids) each -> (sum of the continuation's
        log-probabilities, whether it is the greedy continuation) each, summed in float64."""
        sequences = []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"a continuation must have 1 to max_length = {self.max_length} "
                                 f"tokens, got {len(continuation)}")
            sequences.append((context + continuation)[-(self.max_length + 1):])

        def score(batch: list[int]) -> list[tuple[float, bool]]:
            length = bucket(max(len(sequences[i]) - 1 for i in batch))
            inputs, targets = (np.zeros((self.batch_size, length), np.int32) for _ in range(2))
            for row, i in enumerate(batch):
                inputs[row, :len(sequences[i]) - 1] = sequences[i][:-1]
                targets[row, :len(sequences[i]) - 1] = sequences[i][1:]
            logprobs, greedy = jax.device_get(_token_scores(self._graphdef, self._state, inputs, targets))
            spans = [slice(len(sequences[i]) - 1 - len(requests[i][2]), len(sequences[i]) - 1)
                     for i in batch]
            return [(float(logprobs[row, span].astype(np.float64).sum()), bool(greedy[row, span].all()))
                    for row, span in enumerate(spans)]

        results = self._batched([len(s) for s in sequences], score, disable_tqdm, "loglikelihood")
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each (document,): the sum over its disjoint windows."""
        windows, owners = [], []
        for owner, (document,) in enumerate(request.args for request in requests):
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(document), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, context, target))
                owners.append(owner)
        totals = np.zeros(len(requests))
        np.add.at(totals, owners, [ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm)])
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, float(total))
        return totals.tolist()

    # --- generation ----------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each (context, gen_kwargs), cut before its first stop string
        (gen_kwargs["until"]) and at the end-of-document token; sampled at the temperature (with
        top_k, top_p) unless do_sample is False or the temperature 0 (the default): greedy.
        Contexts keep their last max_length - max_gen_toks tokens."""
        results: list[str | None] = [None] * len(requests)
        groups = defaultdict(list)       # one compiled decoder per set of generation kwargs
        for i, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(i)
        for indices in groups.values():
            texts = self._generate_group([requests[i].args[0] for i in indices],
                                         requests[indices[0]].args[1], disable_tqdm)
            for i, text in zip(indices, texts):
                results[i] = text
        for request, text in zip(requests, results):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return results

    def _generate_group(self, contexts: list[str], gen_kwargs: dict, disable_tqdm: bool) -> list[str]:
        """generate_until of contexts sharing gen_kwargs."""
        unknown = sorted(set(gen_kwargs) - set(GENERATION_KWARGS))
        if unknown:
            raise ValueError(f"generation kwargs {unknown} are not supported (known: "
                             f"{', '.join(GENERATION_KWARGS)})")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        new_tokens = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        if not 0 < new_tokens < self.max_length:
            raise ValueError(f"max_gen_toks must be in [1, max_length = {self.max_length}), "
                             f"got {new_tokens}")
        temperature = 0.0 if gen_kwargs.get("do_sample") is False else float(
            gen_kwargs.get("temperature", 0.0))
        top_k, top_p = gen_kwargs.get("top_k"), gen_kwargs.get("top_p")
        drawing = dict(temperature=temperature, top_k=None if top_k is None else int(top_k),
                       top_p=None if top_p is None else float(top_p))
        prompts = [self.tok_encode(context)[-(self.max_length - new_tokens):] or [self.eot_token_id]
                   for context in contexts]

        def continue_batch(batch: list[int]) -> list[str]:
            length = bucket(max(len(prompts[i]) for i in batch))
            tokens, segment_ids = (np.zeros((self.batch_size, length), np.int32) for _ in range(2))
            for row, i in enumerate(batch):
                tokens[row, length - len(prompts[i]):] = prompts[i]
                segment_ids[row, length - len(prompts[i]):] = 1
            self._rng, rng = jax.random.split(self._rng)
            generated = jax.device_get(generate(self.run.model, tokens, new_tokens, rng=rng,
                                                segment_ids=segment_ids, **drawing))
            return [cut(self._continuation(prompts[i], until_eos(generated[row], self.eot_token_id)), until)
                    for row, i in enumerate(batch)]

        return self._batched([len(p) for p in prompts], continue_batch, disable_tqdm, "generate_until")

    def _continuation(self, prompt: list[int], new: list[int]) -> str:
        """The text of new after prompt: decode(prompt + new) less decode(prompt), so that the
        space SentencePiece pieces carry before them survives at the seam."""
        return self.tok_decode(prompt + new)[len(self.tok_decode(prompt)):]

    def _batched(self, lengths: list[int], run: Callable[[list[int]], list], disable_tqdm: bool,
                 name: str) -> list:
        """run(indices) over batches of at most batch_size items, longest first (the first
        batch shows at once whether the longest fit); its results in the order of lengths."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches = [order[start:start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        results = [None] * len(lengths)
        for batch in tqdm(batches, desc=f"palimpsa {name}", disable=disable_tqdm):
            for i, result in zip(batch, run(batch)):
                results[i] = result
        return results


def cut(text: str, until: Sequence[str]) -> str:
    """text before the first occurrence of any (non-empty) stop string."""
    ends = [text.find(stop) for stop in until if stop]
    return text[:min([e for e in ends if e >= 0], default=len(text))]


@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graphdef, state, inputs, targets):
    """inputs, targets (B, T) int -> log p(target | inputs so far) (B, T) float32, and
    whether the target is the most probable token (B, T) bool."""
    logits, _ = nnx.merge(graphdef, state)(inputs)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked, targets == jnp.argmax(logits, axis=-1)
