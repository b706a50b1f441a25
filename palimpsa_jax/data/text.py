"""Packed language-model text over a local corpus of token ids (nothing is ever downloaded).

Corpus format: `.npy` files holding 1-D arrays of token ids (uint16, uint32 or int32; ids below
2^31), read memory-mapped. A corpus is one file, a glob of shards (`corpus/train-*.npy`, taken in
sorted order) or a list of files and globs (in its order): the files are one stream of tokens, as
if concatenated (`corpus_files`). Every document is followed by `eos_id`, which belongs to the
document it ends (so the model learns to predict it); a final run of tokens without an `eos_id`
is a document too. `write_corpus` writes one file; `palimpsa-prepare` (palimpsa_jax.data.prepare)
writes shards from text.

Packing is concat-then-split: documents are concatenated in stream order and cut into rows of
seq_len tokens; only the last row of a finite stream is padded. A row is
    tokens       int32 (T,)  the token ids, 0 on padding;
    labels       int32 (T,)  the next token of the same document, -100 at a document's last token
                             (its eos) and on padding. A document cut by the end of a row keeps
                             its label at the cut (the next token is in the next row);
    segment_ids  int32 (T,)  the documents (or pieces of documents) of the row numbered from 1,
                             0 on padding.
`pack` does this with grain's ConcatThenSplitIterDataset for a (shuffled, repeated) stream of
`Documents`; `PackedRows` gives the rows of the corpus in stream order by random access (the same
rows `pack` makes from the documents in stream order; a row may span two files), used for
single-pass evaluation.
"""
from __future__ import annotations

import glob
import os
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


def corpus_files(path, name: str = "path") -> list[str]:
    """The files of the corpus `path`: a file, a glob pattern (its matches, sorted; `**` recurses)
    or a list of files and patterns (in its order). A pattern matching nothing is a ValueError
    naming `name`; a plain file is not checked here (np.load reports it missing)."""
    patterns = [path] if isinstance(path, str | os.PathLike) else list(path)
    if not patterns:
        raise ValueError(f"{name} names no file (an empty list)")
    files = []
    for pattern in map(os.fspath, patterns):
        if glob.escape(pattern) == pattern:
            files.append(pattern)
            continue
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ValueError(f"{name} {pattern!r} matches no file")
        files.extend(matches)
    return files


def load_tokens(path) -> np.ndarray:
    """The token ids (N,) of one corpus file, memory-mapped."""
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"path {path} must hold a 1-D integer array (got {tokens.dtype} {tokens.shape})")
    return tokens


class _MappedCorpus:
    """The corpus's files as one stream of tokens, memory-mapped; pickles as its paths (grain's
    worker processes reopen them).

    paths: the files in stream order; shards: their memory-mapped token ids; offsets: int64 (S+1,)
    the stream position where each file starts, then the stream's length.
    """

    def __init__(self, path):
        self.paths = corpus_files(path)
        self._open()

    def _open(self):
        self.shards = [load_tokens(path) for path in self.paths]
        self.offsets = np.cumsum([0, *map(len, self.shards)], dtype=np.int64)

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "shards"}

    def __setstate__(self, state: dict):
        self.__dict__.update(state)
        self._open()

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """int64 (n,): the stream's tokens [start, stop), cut at its end, across files."""
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1    # files [first, last)
        last = int(np.searchsorted(self.offsets, stop, side="left"))            # overlap [start, stop)
        pieces = [shard[max(start - offset, 0):stop - offset]
                  for shard, offset in zip(self.shards[first:last], self.offsets[first:last])]
        return np.concatenate([np.zeros(0, np.int64), *pieces], dtype=np.int64)


class Documents(_MappedCorpus):
    """The documents of the corpus `path` (a file, glob or list: `corpus_files`), a grain
    RandomAccessDataSource; a document may span two files.

    [i] -> {"tokens": int32 (n_i,), "labels": int32 (n_i,)} with labels = the next token of
    document i and -100 at its last token.
    """

    def __init__(self, path, eos_id: int):
        check_int("eos_id", eos_id, 0)
        super().__init__(path)
        ends = [offset + start + np.flatnonzero(shard[start:start + _SCAN_BLOCK] == eos_id) + 1
                for shard, offset in zip(self.shards, self.offsets)
                for start in range(0, len(shard), _SCAN_BLOCK)]
        ends = np.concatenate([np.zeros(0, np.int64), *ends], dtype=np.int64)
        n = self.num_tokens
        unterminated = n > 0 and self.read(n - 1, n)[0] != eos_id
        self.ends = np.append(ends, n) if unterminated else ends
        self.starts = np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = self.read(self.starts[index], self.ends[index]).astype(np.int32)
        labels = np.append(tokens[1:], np.int32(IGNORE))
        return {"tokens": tokens, "labels": labels}


class PackedRows(_MappedCorpus):
    """The corpus in stream order cut into rows of seq_len tokens (random access; layout above)."""

    def __init__(self, path, eos_id: int, seq_len: int):
        check_int("eos_id", eos_id, 0)
        check_int("seq_len", seq_len, 1)
        super().__init__(path)
        self.eos_id = int(eos_id)
        self.seq_len = int(seq_len)

    def __len__(self) -> int:
        return -(-self.num_tokens // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= int(index) < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        start = int(index) * self.seq_len
        window = self.read(start, start + self.seq_len + 1)
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
