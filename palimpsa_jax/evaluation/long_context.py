"""Long-context evaluation: the loss along the positions of long documents, beyond the training
length, and passkey retrieval (a key hidden at a depth of filler text, asked for at its end).

Loss by position. Each held-out document is one row, from its first token, cut at `length`
tokens (documents are not packed, so a position is the position in its document). Position t is
the number of tokens the model has read: its loss is -log p(doc[t] | doc[:t]), t = 1..min(length,
n - 1) for a document of n tokens (its eos included, so the eos is predicted as in training).
Buckets are the intervals (e_k, e_{k+1}] of edges e (default 0, 1, 2, 4, ..., length); a bucket
reports its mean loss, its token count and how many documents reach it: long positions are
averaged over the long documents only (`long_documents(min_length=length)` keeps the same
documents in every bucket).

Passkey. The haystack is a fixed filler, the pieces of a `Haystack`'s filler repeated (Mohtashami
& Jaggi, 2023), so that nothing but the needle is worth remembering; the needle (a random key of
`digits` digits) goes in at the piece boundary nearest to `depth` of the haystack, the question
ends the prompt, and the prompt is exactly `length` tokens (the filler is cut at its start).
A trial is right when the first run of digits of the greedy continuation is the key. Two
haystacks: "prose" (the English sentences of the original task) and "python" (lines of Python,
the needle an assignment, the question an assert: the same task for a model trained on code).
"""
from __future__ import annotations

import functools
import pathlib
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from palimpsa_jax.data.mqar import IGNORE
from palimpsa_jax.models.generate import generate, until_eos


class Haystack(NamedTuple):
    """A passkey task's text: filler pieces repeated, the needle (a format string of `key`) and
    the question, each piece preceded by the separator; the key is asked to follow a space."""
    filler: tuple[str, ...]
    needle: str
    question: str
    separator: str


HAYSTACKS = {
    "prose": Haystack(("The grass is green.", "The sky is blue.", "The sun is yellow.",
                       "Here we go.", "There and back again."),
                      "The pass key is {key}. Remember it.", "What is the pass key? The pass key is",
                      " "),
    "python": Haystack(("import os", "x = [1, 2, 3]", "y = sum(x)", "print(x, y)", "z = x + [y]"),
                       "PASS_KEY = {key}", "assert PASS_KEY ==", "\n"),
}

# continue_fn(prompts int32 (B, T), max_new_tokens) -> the continuations' ids (B, max_new_tokens)
ContinueFn = Callable[[np.ndarray, int], np.ndarray]


# --- loss by position --------------------------------------------------------------------

class PositionLoss(NamedTuple):
    """Per bucket k of positions first[k]..last[k] (both included): mean_loss float64 (K,), the
    mean next-token loss in nats (nan if empty); count int (K,), the tokens predicted there;
    documents int (K,), the documents that reach first[k]."""
    first: np.ndarray
    last: np.ndarray
    mean_loss: np.ndarray
    count: np.ndarray
    documents: np.ndarray

    def rows(self) -> list[dict]:
        """One dict per bucket (for CSV and JSON; mean_loss None where empty)."""
        return [{"first": int(f), "last": int(l), "mean_loss": float(m) if c else None, "count": int(c),
                 "documents": int(d)} for f, l, m, c, d in zip(*self)]

    @classmethod
    def from_rows(cls, rows: list[dict]) -> PositionLoss:
        return cls(*(np.array([row[name] for row in rows], float if name == "mean_loss" else int)
                     for name in cls._fields))


def default_edges(length: int) -> list[int]:
    """0, 1, 2, 4, ... (powers of two below length), length."""
    return [0] + [2**i for i in range(max(length - 1, 1).bit_length()) if 2**i < length] + [length]


def long_documents(documents, *, min_length: int = 0, count: int | None = None) -> list[np.ndarray]:
    """The token ids of the first `count` (default all) documents of a `data.Documents` that
    have at least min_length tokens (their eos included), in corpus order."""
    lengths = documents.ends - documents.starts
    chosen = np.flatnonzero(lengths >= min_length)[:count]
    return [documents[int(i)]["tokens"] for i in chosen]


def loss_by_position(model: nnx.Module, documents: Sequence, *, length: int, batch_size: int = 8,
                     buckets: Sequence[int] | None = None) -> PositionLoss:
    """The mean next-token loss of `model` by position up to `length` (module docstring).

    documents: 1-D arrays of token ids (or `data.Documents` items, dicts with "tokens"), one
    document each; buckets: the edges e_0 < ... < e_K in [0, length], default `default_edges`.
    One forward of (batch_size, length) tokens per batch (compiled once; the last batch padded
    with empty rows), so memory holds batch_size x length x vocab float32 logits.
    """
    if not (isinstance(length, int) and length >= 1):
        raise ValueError(f"length must be an integer >= 1, got {length!r}")
    edges = np.asarray(default_edges(length) if buckets is None else buckets)
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if edges.ndim != 1 or len(edges) < 2 or np.any(np.diff(edges) <= 0) or edges[0] < 0 or edges[-1] > length:
        raise ValueError(f"buckets must be increasing edges in [0, length={length}], got {buckets!r}")
    docs = [np.asarray(d["tokens"] if isinstance(d, dict) else d).reshape(-1) for d in documents]
    if not docs:
        raise ValueError("documents is empty")
    graphdef, state = nnx.split(model)
    sums, counts = np.zeros(length), np.zeros(length, np.int64)   # at index t - 1
    for start in range(0, len(docs), batch_size):
        tokens = np.zeros((batch_size, length), np.int32)
        labels = np.full((batch_size, length), IGNORE, np.int32)
        for row, doc in enumerate(docs[start:start + batch_size]):
            n = min(length, len(doc) - 1)
            tokens[row, :n], labels[row, :n] = doc[:n], doc[1:n + 1]
        sums += np.asarray(_token_losses(graphdef, state, tokens, labels), np.float64).sum(0)
        counts += (labels != IGNORE).sum(0)
    first, last = edges[:-1] + 1, edges[1:]
    bucket_sums, bucket_counts = (np.add.reduceat(x[:last[-1]], edges[:-1]) for x in (sums, counts))
    mean = np.divide(bucket_sums, bucket_counts, out=np.full(len(first), np.nan), where=bucket_counts > 0)
    reached = (np.array([len(doc) - 1 for doc in docs])[None, :] >= first[:, None]).sum(1)
    return PositionLoss(first, last, mean, bucket_counts, reached)


@functools.partial(jax.jit, static_argnums=0)
def _token_losses(graphdef, state, tokens, labels):
    """-log p(label | prefix) (B, T) float32, 0 where the label is IGNORE."""
    logits, _ = nnx.merge(graphdef, state)(tokens)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels == IGNORE, 0.0, -picked)


# --- passkey -----------------------------------------------------------------------------

class PasskeyPrompt(NamedTuple):
    """tokens int32 (length,): filler[:needle_start], the needle, filler[needle_start:], the
    question; key: the digits asked for; filler_tokens: the number of filler tokens."""
    tokens: np.ndarray
    key: str
    needle_start: int
    filler_tokens: int


def _piece(tokenizer, text: str, separator: str = " ") -> list[int]:
    """The ids of text as it reads after the separator in running text (SentencePiece drops a
    leading space and adds its own word-start mark; byte-level BPE keeps it on the first word)."""
    return tokenizer.encode(separator + text)


def passkey_prompt(tokenizer, length: int, depth: float, key: str, *,
                   haystack: Haystack = HAYSTACKS["prose"]) -> PasskeyPrompt:
    """The passkey prompt of exactly `length` tokens with the needle at the piece boundary of the
    haystack nearest to depth (in [0, 1]) of its tokens: before a whole piece or at the end (the
    first piece, cut at its start, comes before the needle at depth 0)."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    piece = lambda text: _piece(tokenizer, text, haystack.separator)
    needle, question = piece(haystack.needle.format(key=key)), piece(haystack.question)
    filler_tokens = length - len(needle) - len(question)
    if filler_tokens < 0:
        raise ValueError(f"length must be at least {len(needle) + len(question)} tokens (the needle "
                         f"and the question), got {length}")
    pieces = [piece(s) for s in haystack.filler]
    stream, ends = [], []
    while len(stream) < filler_tokens:
        stream += pieces[len(ends) % len(pieces)]
        ends.append(len(stream))
    cut = len(stream) - filler_tokens                # the filler loses its first `cut` tokens
    starts = [0] + ends[:-1]                         # the needle goes before a whole piece or last
    boundaries = np.array([b - cut for b in starts if b >= cut] + [filler_tokens])
    at = int(boundaries[np.argmin(np.abs(boundaries - depth * filler_tokens))])
    hay = stream[cut:]
    tokens = np.array(hay[:at] + needle + hay[at:] + question, np.int32)
    return PasskeyPrompt(tokens, key, at, filler_tokens)


def greedy(model: nnx.Module) -> ContinueFn:
    """The continue_fn of greedy decoding with `models.generate` (recurrent cache)."""
    return lambda prompts, n: np.asarray(generate(model, prompts, n, temperature=0.0))


def answer(tokenizer, continuation) -> str | None:
    """The first run of digits in the decoded continuation (up to its eos), None if none."""
    match = re.search(r"\d+", tokenizer.decode(until_eos(continuation, tokenizer.eos_id)))
    return match[0] if match else None


class PasskeyResult(NamedTuple):
    """accuracy float (D, L): the fraction of right trials at depths[d], lengths[l]."""
    accuracy: np.ndarray
    lengths: list[int]
    depths: list[float]
    trials: int

    def to_json(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "trials": self.trials,
                "accuracy": self.accuracy.tolist()}


def passkey_accuracy(model: nnx.Module | ContinueFn, tokenizer, *, lengths: Sequence[int],
                     depths: Sequence[float], trials: int, seed: int = 0, digits: int = 5,
                     batch_size: int | None = None,
                     haystack: Haystack = HAYSTACKS["prose"]) -> PasskeyResult:
    """Passkey accuracy over lengths x depths, `trials` random keys each (module docstring).

    model: a CausalLM (greedy decoding) or a continue_fn(prompts (B, T), max_new_tokens) -> ids
    (B, max_new_tokens). The trials of a length form batches of batch_size prompts (default:
    all depths x trials at once; the last batch padded), so one compilation per length. The
    continuation is as long as the longest key's ids plus one.
    """
    if not (isinstance(trials, int) and trials >= 1):
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    if not (isinstance(digits, int) and digits >= 1):
        raise ValueError(f"digits must be an integer >= 1, got {digits!r}")
    continue_fn = greedy(model) if isinstance(model, nnx.Module) else model
    keys = np.random.default_rng(seed).integers(10 ** (digits - 1), 10**digits,
                                                size=(len(lengths), len(depths), trials))
    new_tokens = 1 + max(len(_piece(tokenizer, str(k))) for k in keys.flat)
    accuracy = np.zeros((len(depths), len(lengths)))
    for l, length in enumerate(lengths):
        prompts = [passkey_prompt(tokenizer, length, depth, str(key), haystack=haystack)
                   for depth, row in zip(depths, keys[l]) for key in row]
        size = batch_size or len(prompts)
        right = []
        for start in range(0, len(prompts), size):
            chunk = prompts[start:start + size]
            batch = np.stack([p.tokens for p in chunk] + [chunk[0].tokens] * (size - len(chunk)))
            continuations = np.asarray(continue_fn(batch, new_tokens))
            right += [answer(tokenizer, c) == p.key for p, c in zip(chunk, continuations)]
        accuracy[:, l] = np.reshape(right, (len(depths), trials)).mean(1)
    return PasskeyResult(accuracy, [int(x) for x in lengths], [float(x) for x in depths], trials)


# --- figures -----------------------------------------------------------------------------

def plot_loss_by_position(curves: dict[str, PositionLoss], path: pathlib.Path, *,
                          training_length: int | None = None) -> None:
    """Mean loss against position (log x, each bucket at its geometric middle), one line per
    label; a dotted line at the training length when given."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(6, 3.6), dpi=120)
    ax = fig.subplots()
    for label, table in curves.items():
        ax.plot(np.sqrt(table.first * table.last), table.mean_loss, "o-", ms=3, label=label)
    if training_length:
        ax.axvline(training_length, color="gray", ls=":", label="training length")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="position in the document (tokens read)", ylabel="mean next-token loss (nats)",
           title="loss by position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_passkey(result: PasskeyResult, path: pathlib.Path, *, title: str = "passkey accuracy") -> None:
    """Heatmap of the accuracy: x the context length, y the needle's depth, values printed."""
    from matplotlib.figure import Figure

    width = 1.2 + 0.9 * len(result.lengths)
    fig = Figure(figsize=(width, 1.2 + 0.5 * len(result.depths)), dpi=120)
    ax = fig.subplots()
    image = ax.imshow(result.accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    for (d, l), value in np.ndenumerate(result.accuracy):
        ax.text(l, d, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(result.lengths)), [str(x) for x in result.lengths])
    ax.set_yticks(range(len(result.depths)), [f"{x:g}" for x in result.depths])
    ax.set(xlabel="context length (tokens)", ylabel="needle depth")
    # wrapped to the figure's width (about 11 characters of 9-point text per inch)
    ax.set_title(textwrap.fill(f"{title} ({result.trials} trials)", int(11 * width)), fontsize=9)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, format="png")
