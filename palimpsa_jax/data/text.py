"""Packed language-model text over a local corpus of token ids (nothing is ever downloaded).

Corpus format: one `.npy` file holding a 1-D array of token ids (uint16, uint32 or int32; ids
below 2^31), read memory-mapped. Every document is followed by `eos_id`, which belongs to the
document it ends (so the model learns to predict it); a final run of tokens without an `eos_id`
is a document too. `write_corpus` writes this format.

Packing is concat-then-split: documents are concatenated in stream order and cut into rows of
seq_len tokens; only the last row of a finite stream is padded. A row is
    tokens       int32 (T,)  the token ids, 0 on padding;
    labels       int32 (T,)  the next token of the same document, -100 at a document's last token
                             (its eos) and on padding. A document cut by the end of a row keeps
                             its label at the cut (the next token is in the next row);
    segment_ids  int32 (T,)  the documents (or pieces of documents) of the row numbered from 1,
                             0 on padding.
`pack` does this with grain's ConcatThenSplitIterDataset for a (shuffled, repeated) stream of
`Documents`; `PackedRows` gives the rows of the corpus in file order by random access (the same
rows `pack` makes from the documents in file order), used for single-pass evaluation.
"""
from __future__ import annotations

import pathlib

import grain
import numpy as np

from palimpsa_jax.data.mqar import IGNORE, check_int

_SCAN_BLOCK = 1 << 24   # tokens per block when looking for document ends


def write_corpus(path, documents, *, eos_id: int) -> pathlib.Path:
    """Writes documents (lists of token ids, none equal to eos_id) as a corpus file; returns path.

    The dtype is uint16 when every id (eos_id included) is below 2^16, else uint32.
    """
    check_int("eos_id", eos_id, 0)
    arrays = [np.asarray(doc, np.int64).reshape(-1) for doc in documents]
    for i, doc in enumerate(arrays):
        if np.any(doc < 0) or np.any(doc >= 2**31) or np.any(doc == eos_id):
            raise ValueError(f"documents[{i}] must hold ids in [0, 2^31) other than eos_id={eos_id}")
    stream = np.concatenate([np.append(doc, eos_id) for doc in arrays] or [np.zeros(0, np.int64)])
    dtype = np.uint16 if stream.size == 0 or stream.max() < 2**16 else np.uint32
    path = pathlib.Path(path)
    np.save(path, stream.astype(dtype), allow_pickle=False)
    return path


def load_tokens(path) -> np.ndarray:
    """The corpus's token ids (N,), memory-mapped."""
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"path {path} must hold a 1-D integer array (got {tokens.dtype} {tokens.shape})")
    return tokens


class _MappedCorpus:
    """Holds the memory-mapped corpus; pickles as its path (grain's worker processes reopen it)."""

    def __init__(self, path):
        self.path = str(path)
        self.tokens = load_tokens(self.path)

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "tokens"}

    def __setstate__(self, state: dict):
        self.__dict__.update(state)
        self.tokens = load_tokens(self.path)


class Documents(_MappedCorpus):
    """The corpus's documents (a grain RandomAccessDataSource).

    [i] -> {"tokens": int32 (n_i,), "labels": int32 (n_i,)} with labels = the next token of
    document i and -100 at its last token.
    """

    def __init__(self, path, eos_id: int):
        check_int("eos_id", eos_id, 0)
        super().__init__(path)
        ends = [start + np.flatnonzero(self.tokens[start:start + _SCAN_BLOCK] == eos_id) + 1
                for start in range(0, len(self.tokens), _SCAN_BLOCK)]
        ends = np.concatenate(ends or [np.zeros(0, np.int64)]).astype(np.int64)
        unterminated = len(self.tokens) > 0 and self.tokens[-1] != eos_id
        self.ends = np.append(ends, len(self.tokens)) if unterminated else ends
        self.starts = np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = np.asarray(self.tokens[self.starts[index]:self.ends[index]], np.int32)
        labels = np.append(tokens[1:], np.int32(IGNORE))
        return {"tokens": tokens, "labels": labels}


class PackedRows(_MappedCorpus):
    """The corpus in file order cut into rows of seq_len tokens (random access; layout above)."""

    def __init__(self, path, eos_id: int, seq_len: int):
        check_int("eos_id", eos_id, 0)
        check_int("seq_len", seq_len, 1)
        super().__init__(path)
        self.eos_id = int(eos_id)
        self.seq_len = int(seq_len)

    def __len__(self) -> int:
        return -(-len(self.tokens) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= int(index) < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        start = int(index) * self.seq_len
        window = np.asarray(self.tokens[start:start + self.seq_len + 1], np.int64)
        n = min(self.seq_len, len(window))
        piece = window[:n]
        is_end = piece == self.eos_id
        following = np.full(n, IGNORE, np.int64)
        following[:len(window) - 1] = window[1:]
        row = padding_row(self.seq_len)
        row["tokens"][:n] = piece
        row["labels"][:n] = np.where(is_end, IGNORE, following)
        row["segment_ids"][:n] = 1 + np.concatenate([[0], np.cumsum(is_end[:-1])])
        return row


def padding_row(seq_len: int) -> dict[str, np.ndarray]:
    """A row of padding only: tokens 0, labels -100, segment_ids 0, each int32 (seq_len,)."""
    return {"tokens": np.zeros(seq_len, np.int32), "labels": np.full(seq_len, IGNORE, np.int32),
            "segment_ids": np.zeros(seq_len, np.int32)}


def pack(documents: grain.IterDataset, seq_len: int) -> grain.IterDataset:
    """Concat-then-split rows (layout above) of a stream of `Documents` elements."""
    check_int("seq_len", seq_len, 1)
    packed = grain.experimental.ConcatThenSplitIterDataset(
        documents, length_struct={"tokens": seq_len, "labels": seq_len})
    return _JsonSafeState(packed).map(_row)


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids = packed["tokens_segment_ids"].astype(np.int32)
    return {"tokens": packed["tokens"].astype(np.int32),
            "labels": np.where(segment_ids > 0, packed["labels"], IGNORE).astype(np.int32),
            "segment_ids": segment_ids}


class _JsonSafeState(grain.IterDataset):
    """ConcatThenSplitIterDataset whose iterator state survives a JSON round trip.

    grain 0.2.18 tests its restored `remainder_slices` against the tuple (-1, -1); after JSON they
    are lists, an empty remainder is taken for a real one and the stream is corrupted. The
    slices are turned back into tuples before the state is set.
    """

    def __iter__(self) -> grain.DatasetIterator:
        return _JsonSafeStateIterator(self._parent.__iter__())


class _JsonSafeStateIterator(grain.DatasetIterator):
    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        slices = {key: tuple(value) for key, value in state["remainder_slices"].items()}
        self._parent.set_state({**state, "remainder_slices": slices})
