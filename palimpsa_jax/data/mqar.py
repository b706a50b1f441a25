"""Multi-query associative recall (MQAR), Zoology's `multiquery_ar` layout (README "MQAR").

One example of length T with P pairs (V = vocab_size), e.g. T = 16, P = 3:

    tokens   k1 v1 k2 v2 k3 v3 | k2  0  0  0 k1  0 k3  0  0  0
    labels   -100 ...     -100 | v2 -100  ...  v1 -100 v3 -100 ...

- keys drawn without replacement from [1, V/2), values drawn without replacement from [V/2, V)
  (Zoology draws both without replacement, so the P values of an example differ); the first 2P
  tokens are the pairs k1 v1 ... kP vP;
- after them come space = (T - 2P) // 2 query slots at the even offsets 2P + 2(g - 1),
  g = 1..space. Key i sits at slot g_i, where g_1..g_P are drawn one after the other without
  replacement with p(g) ∝ g^(a-1) (a = power_a = 0.01: mostly short gaps), as Zoology's
  `np.random.choice(space, P, replace=False, p=p)` does;
- labels[t] is the value paired with tokens[t] where tokens[t] is a query, -100 elsewhere: the
  model reads the query key and is scored on predicting its value next (Zoology's inputs and
  labels after its one-token shift, without its random filler); every other token is 0.

Requirements: num_pairs >= 1, vocab_size even with vocab_size >= 2 num_pairs + 2 (P distinct keys
from the V/2 - 1 keys), seq_len >= 4 num_pairs (space >= P, Zoology's condition; an odd seq_len
leaves its last position 0), power_a > 0.

Splits are disjoint by construction: example i of split s (train 0, test 1) is drawn from
`np.random.default_rng([seed, s, i, attempt])` for attempt = 0, 1, ...: the pair block first,
kept only if a 64-bit BLAKE2b hash of it is congruent to s modulo 2 (otherwise the next attempt),
then the query gaps. Equal token sequences have equal pair counts (a third of their non-zero
tokens) and pair blocks, hence equal hashes: no sequence can be in both splits, whatever the
settings of either. Example i depends only on (seed, split, i, the settings); settings with too
few distinct pair blocks for a split raise ValueError after MAX_ATTEMPTS attempts.
"""
from __future__ import annotations

import hashlib
import math
import numbers

import numpy as np

SPLITS = ("train", "test")
IGNORE = -100
MAX_ATTEMPTS = 256   # each attempt lands in a given split with probability ~1/2


def check_int(name: str, value, minimum: int):
    """Raises ValueError, naming `name`, unless value is an integer (not a bool) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r})")


def check_arguments(*, vocab_size, seq_len, num_pairs, power_a) -> None:
    """Raises ValueError, naming the argument, unless the settings can make an example."""
    check_int("num_pairs", num_pairs, 1)
    check_int("vocab_size", vocab_size, 2 * num_pairs + 2)
    if vocab_size % 2:
        raise ValueError(f"vocab_size must be even (got {vocab_size})")
    check_int("seq_len", seq_len, 4 * num_pairs)
    if not (isinstance(power_a, numbers.Real) and math.isfinite(power_a) and power_a > 0):
        raise ValueError(f"power_a must be a finite number > 0 (got {power_a!r})")


def gap_distribution(space: int, power_a: float) -> np.ndarray:
    """p(g) ∝ g^(power_a - 1) for the gaps g = 1..space, as an array (space,) indexed by g - 1."""
    p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    return p / p.sum()


def mqar_example(rng: np.random.Generator, *, vocab_size: int, seq_len: int, num_pairs: int,
             power_a: float = 0.01) -> dict[str, np.ndarray]:
    """One example: {"tokens": int32 (seq_len,), "labels": int32 (seq_len,)} (layout above)."""
    check_arguments(vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, power_a=power_a)
    log_p = np.log(gap_distribution((seq_len - 2 * num_pairs) // 2, power_a))
    return _example(rng, _pair_block(rng, vocab_size, num_pairs), seq_len, log_p)


def _pair_block(rng: np.random.Generator, vocab_size: int, num_pairs: int) -> np.ndarray:
    """k1 v1 ... kP vP: int32 (2P,)."""
    half = vocab_size // 2
    block = np.empty(2 * num_pairs, np.int32)
    block[0::2] = 1 + rng.choice(half - 1, size=num_pairs, replace=False)
    block[1::2] = half + rng.choice(half, size=num_pairs, replace=False)
    return block


def _example(rng: np.random.Generator, block: np.ndarray, seq_len: int,
             log_p: np.ndarray) -> dict[str, np.ndarray]:
    """The example with pair block `block` (2P,) and queries placed by log p(g) (space,)."""
    num_pairs = len(block) // 2
    # Gumbel-top-k: the P largest log p(g) + Gumbel noise, in decreasing order, are distributed
    # exactly as P successive draws without replacement from p (and cost one sort).
    gaps = 1 + np.argsort(-(log_p + rng.gumbel(size=len(log_p))))[:num_pairs]
    queries = 2 * num_pairs + 2 * (gaps - 1)
    tokens = np.zeros(seq_len, np.int32)
    tokens[:2 * num_pairs] = block
    tokens[queries] = block[0::2]
    labels = np.full(seq_len, IGNORE, np.int32)
    labels[queries] = block[1::2]
    return {"tokens": tokens, "labels": labels}


def split_of(block: np.ndarray) -> int:
    """The split id (index into SPLITS) a pair block (2P,) may belong to: its hash mod 2."""
    digest = hashlib.blake2b(np.asarray(block, "<i4").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % len(SPLITS)


class MQARSource:
    """Random-access MQAR split (a grain RandomAccessDataSource): len, and [i] -> example i."""

    def __init__(self, split: str, num_examples: int, vocab_size: int, seq_len: int, num_pairs: int,
                 seed: int, power_a: float = 0.01):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
        check_int("num_examples", num_examples, 0)
        check_int("seed", seed, 0)
        check_arguments(vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, power_a=power_a)
        self.split_id = SPLITS.index(split)
        self.num_examples = int(num_examples)
        self.seed = int(seed)
        self.vocab_size, self.seq_len, self.num_pairs = int(vocab_size), int(seq_len), int(num_pairs)
        self.power_a = float(power_a)
        self.log_p = np.log(gap_distribution((self.seq_len - 2 * self.num_pairs) // 2, self.power_a))

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        for attempt in range(MAX_ATTEMPTS):
            rng = np.random.default_rng([self.seed, self.split_id, index, attempt])
            block = _pair_block(rng, self.vocab_size, self.num_pairs)
            if split_of(block) == self.split_id:
                return _example(rng, block, self.seq_len, self.log_p)
        raise ValueError(f"{self!r} draws no {SPLITS[self.split_id]} example in {MAX_ATTEMPTS} "
                         "attempts: these settings allow too few distinct examples")

    def __repr__(self) -> str:
        return (f"MQARSource(split={SPLITS[self.split_id]!r}, num_examples={self.num_examples}, "
                f"vocab_size={self.vocab_size}, seq_len={self.seq_len}, num_pairs={self.num_pairs}, "
                f"seed={self.seed}, power_a={self.power_a})")
