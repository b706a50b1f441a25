"""Local text to training corpora: the work of `palimpsa-prepare` (palimpsa_jax.commands.prepare).

Inputs are files or glob patterns (`**` recurses; each pattern's matches sorted), read by extension:
    .jsonl, .ndjson   JSON Lines: a document per line, in the field `text_field`;
    .parquet          Parquet: a document per row, in the column `text_field`, read in row batches;
    anything else     plain UTF-8 text: the whole file is one document, byte for byte;
each but Parquet optionally gzip'd (a final .gz). Formats that reading as text would garble
(.json, .csv, archives, ...) are refused. Empty documents (and null fields) are skipped.

A document goes to the validation split when a keyed hash of its text (blake2b, key split_seed),
read as a number in [0, 1), is below validation_fraction: the split depends on the text alone, so
it is the same in every run and with any number of workers, and duplicates share a split. Worker
processes tokenize (the Tokenizer pickles as its file; no special tokens are added) and the
documents are written in input order, each followed by eos_id, as
    OUT/train-00000.npy, ...       shards of the corpus format (palimpsa_jax.data.text) of at most
    OUT/validation-00000.npy, ...  shard_tokens tokens, all of one dtype; a document is never split
                                   (one longer than shard_tokens is a shard of its own);
    OUT/tokenizer.json | .model    the tokenizer (given, or a byte-level BPE trained on the first
                                   tokenizer_sample_docs training documents);
    OUT/corpus.json                written last: the tokenizer file, vocab_size, eos_id, dtype, the
                                   documents and tokens (eos included) of each split and shard, the
                                   documents dropped, the settings, inputs, files and command line.
A document whose tokens include eos_id is dropped (and counted), so eos_id only ever ends a
document. Text holding a special token (e.g. "<|endoftext|>") encodes as ordinary text
(`Tokenizer`), so this happens only where eos_token names an ordinary piece. With workers > 1
the processes are spawned (not forked), so a script calling `prepare` must keep its own work
under `if __name__ == "__main__":`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from palimpsa_jax.data.mqar import check_int
from palimpsa_jax.data.tokenizer import FILE_NAMES, Tokenizer, train_bpe

SPLITS = ("train", "validation")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
REFUSED_SUFFIXES = (".json", ".csv", ".tsv", ".npy", ".npz", ".zip", ".tar", ".bz2", ".xz", ".zst", ".7z",
                    ".arrow", ".feather")
FORMATS_HELP = ("the formats are JSON Lines (.jsonl, .ndjson), Parquet (.parquet) and plain UTF-8 text "
                "(any other extension), each but Parquet optionally gzip'd (.gz)")
_BATCH_CHARS = 1 << 20      # characters of text per worker task
_PARQUET_ROWS = 1024        # rows per Parquet read


def input_files(patterns: Sequence[str | os.PathLike]) -> list[pathlib.Path]:
    """The files of the --input patterns in order (a file matched twice is read once); each
    must match a file of a readable format."""
    if isinstance(patterns, str | os.PathLike) or not patterns:
        raise ValueError(f"--input must be a list of files or glob patterns (got {patterns!r})")
    files = {}
    for pattern in map(os.fspath, patterns):
        matches = [pathlib.Path(m) for m in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(m)]
        if not matches:
            hint = f" (a directory: give a pattern such as '{pattern}/**/*.txt')" if os.path.isdir(pattern) else ""
            raise ValueError(f"--input {pattern!r} matches no file{hint}")
        files.update(dict.fromkeys(matches))
    for path in files:
        input_format(path)
    return list(files)


def input_format(path: pathlib.Path) -> str:
    """"jsonl", "parquet" or "text", by the file's extension (a final .gz aside)."""
    name = path.name.lower()
    compressed = name.endswith(".gz")
    suffix = pathlib.PurePath(name.removesuffix(".gz")).suffix
    if suffix in REFUSED_SUFFIXES or (suffix == ".parquet" and compressed):
        raise ValueError(f"--input file {path}: {suffix}{'.gz' if compressed else ''} files are not read; "
                         f"{FORMATS_HELP}")
    return "parquet" if suffix == ".parquet" else "jsonl" if suffix in JSONL_SUFFIXES else "text"


def read_documents(path: pathlib.Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file in order ("" for an empty or null field)."""
    reader = {"jsonl": _jsonl_documents, "parquet": _parquet_documents, "text": _text_document}
    try:
        yield from reader[input_format(path)](path, text_field)
    except (OSError, EOFError, ValueError) as e:      # unreadable, bad gzip, JSON, Parquet or UTF-8
        raise ValueError(f"--input file {path}: {e}") from e


def _open_text(path: pathlib.Path):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8", newline="")     # newline="": no newline translation


def _text_document(path: pathlib.Path, text_field: str) -> Iterator[str]:
    try:
        with _open_text(path) as file:
            yield file.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start}); {FORMATS_HELP}") from None


def _jsonl_documents(path: pathlib.Path, text_field: str) -> Iterator[str]:
    with _open_text(path) as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {number} is not JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"line {number} has no field {text_field!r} (--text_field)")
            text = record[text_field]
            if not isinstance(text, str | None):
                raise ValueError(f"line {number}: field {text_field!r} (--text_field) holds "
                                 f"{type(text).__name__}, not text")
            yield text or ""


def _parquet_documents(path: pathlib.Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        schema = file.schema_arrow
        if text_field not in schema.names:
            raise ValueError(f"no column {text_field!r} (--text_field); its columns are {schema.names}")
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"column {text_field!r} (--text_field) holds {kind}, not text")
        for batch in file.iter_batches(batch_size=_PARQUET_ROWS, columns=[text_field]):
            yield from (text or "" for text in batch.column(0).to_pylist())


def split_of(text: str, validation_fraction: float, split_seed: int = 0) -> str:
    """"validation" when the hash of text keyed by split_seed, in [0, 1), is below
    validation_fraction, else "train"."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=split_seed.to_bytes(8, "little")).digest()
    return "validation" if int.from_bytes(digest, "little") < validation_fraction * 2**64 else "train"


@dataclasses.dataclass(frozen=True)
class _Encoder:
    """texts -> [(split, token ids and eos_id as dtype (n+1,), or None where an id is eos_id)]."""

    tokenizer: Tokenizer
    dtype: str
    validation_fraction: float
    split_seed: int

    def __call__(self, texts: list[str]) -> list[tuple[str, np.ndarray | None]]:
        eos_id = self.tokenizer.eos_id
        encoded = []
        for text, ids in zip(texts, self.tokenizer.encode_batch(texts)):
            tokens = np.array([*ids, eos_id], self.dtype)
            encoded.append((split_of(text, self.validation_fraction, self.split_seed),
                            None if np.any(tokens[:-1] == eos_id) else tokens))
        return encoded


class _ShardWriter:
    """Writes one split's documents to directory/<split>-00000.npy, ... of at most shard_tokens
    tokens each (a longer document alone); `shards` describes the files written."""

    def __init__(self, directory: pathlib.Path, split: str, shard_tokens: int):
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.pieces, self.size, self.shards = [], 0, []

    def add(self, tokens: np.ndarray):
        if self.pieces and self.size + len(tokens) > self.shard_tokens:
            self.flush()
        self.pieces.append(tokens)
        self.size += len(tokens)

    def flush(self):
        if self.pieces:
            name = f"{self.split}-{len(self.shards):05d}.npy"
            np.save(self.directory / name, np.concatenate(self.pieces), allow_pickle=False)
            self.shards.append({"file": name, "documents": len(self.pieces), "tokens": self.size})
            self.pieces, self.size = [], 0

    def summary(self) -> dict:
        return {"documents": sum(s["documents"] for s in self.shards),
                "tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}


def prepare(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
            tokenizer: str | os.PathLike | None = None, eos_token: str | None = None,
            train_tokenizer: bool = False, vocab_size: int | None = None, tokenizer_sample_docs: int = 100_000,
            text_field: str = "text", validation_fraction: float = 0.01, split_seed: int = 0,
            shard_tokens: int = 100_000_000, workers: int | None = None, overwrite: bool = False,
            command: str | None = None) -> dict:
    """Writes the corpus of the documents of `inputs` to the directory `output` (layout above) and
    returns the content of its corpus.json.

    The arguments are the flags of palimpsa-prepare (workers=None: min(cpu_count, 8)); a bad one
    is a ValueError naming the flag. tokenizer: a tokenizer.json or .model file (eos_token: its
    end-of-document token, by default the first known one), or train_tokenizer: train a byte-level
    BPE of vocab_size ids; tokenizer_sample_docs=0 trains on every training document.
    """
    workers = min(os.cpu_count() or 1, 8) if workers is None else workers
    if bool(tokenizer) == train_tokenizer:
        raise ValueError("pass one of --tokenizer (a tokenizer file) and --train_tokenizer (with --vocab_size)")
    if train_tokenizer != (vocab_size is not None):
        raise ValueError("--vocab_size goes with --train_tokenizer (a --tokenizer file has its own)")
    if train_tokenizer and eos_token is not None:
        raise ValueError("--eos_token goes with --tokenizer (a trained tokenizer's is <|endoftext|>)")
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"--validation_fraction must be in [0, 1) (got {validation_fraction!r})")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"--text_field must name a field (got {text_field!r})")
    for name, value, minimum in (("shard_tokens", shard_tokens, 1), ("workers", workers, 1),
                                 ("tokenizer_sample_docs", tokenizer_sample_docs, 0),
                                 ("split_seed", split_seed, 0)):
        check_int(f"--{name}", value, minimum)
    if split_seed >= 2**64:
        raise ValueError(f"--split_seed must be below 2^64 (got {split_seed})")
    files = input_files(inputs)
    texts = lambda: itertools.chain.from_iterable(read_documents(path, text_field) for path in files)
    if not train_tokenizer:
        try:
            tok = Tokenizer(tokenizer, eos_token=eos_token)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer: {e}") from None
    output = pathlib.Path(output)
    _clear(output, tokenizer, overwrite)
    if train_tokenizer:
        sample = (t for t in texts() if t and split_of(t, validation_fraction, split_seed) == "train")
        tok = train_bpe(itertools.islice(sample, tokenizer_sample_docs or None), vocab_size,
                        output / FILE_NAMES["huggingface"])
    else:
        tok.save(output)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    encoder = _Encoder(tok, dtype, float(validation_fraction), int(split_seed))

    writers = {split: _ShardWriter(output, split, shard_tokens) for split in SPLITS}
    dropped = collections.Counter(empty=0, containing_eos_id=0)

    def documents() -> Iterator[str]:
        for text in texts():
            if text:
                yield text
            else:
                dropped["empty"] += 1

    with tqdm(unit="doc", desc="tokenizing", disable=None) as bar:
        for encoded in _in_workers(encoder, _batches(documents(), _BATCH_CHARS), workers):
            for split, tokens in encoded:
                if tokens is None:
                    dropped["containing_eos_id"] += 1
                else:
                    writers[split].add(tokens)
            bar.update(len(encoded))
    for writer in writers.values():
        writer.flush()
    if not any(writer.shards for writer in writers.values()):
        raise ValueError(f"--input: the files hold no documents ({dict(dropped)} dropped)")

    corpus = {"tokenizer": FILE_NAMES[tok.kind], "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
              "dtype": dtype, "splits": {split: writer.summary() for split, writer in writers.items()},
              "dropped_documents": dict(dropped), "validation_fraction": validation_fraction,
              "split_seed": split_seed, "shard_tokens": shard_tokens, "text_field": text_field,
              "inputs": [os.fspath(p) for p in inputs], "files": [str(p) for p in files], "command": command}
    (output / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")
    return corpus


def _clear(output: pathlib.Path, tokenizer, overwrite: bool):
    """Makes the directory output; removes an earlier corpus there (--overwrite) or refuses to."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is not a directory")
    keep = pathlib.Path(tokenizer).resolve() if tokenizer else None
    earlier = [output / name for name in ("corpus.json", *FILE_NAMES.values()) if (output / name).exists()]
    earlier += [path for split in SPLITS for path in sorted(output.glob(f"{split}-*.npy"))]
    earlier = [path for path in earlier if path.resolve() != keep]
    if earlier and not overwrite:
        raise ValueError(f"--output {output} already holds a corpus ({', '.join(p.name for p in earlier[:3])}"
                         f"{', ...' if len(earlier) > 3 else ''}): pass --overwrite to replace it")
    for path in earlier:
        path.unlink()
    output.mkdir(parents=True, exist_ok=True)


def _batches(texts: Iterable[str], chars: int) -> Iterator[list[str]]:
    """texts in consecutive lists of about `chars` characters (at least one text each)."""
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _in_workers(function: Callable, batches: Iterable, workers: int) -> Iterator:
    """function(batch) for each batch in order, computed by `workers` processes (this one for 1),
    at most 2 x workers batches ahead of the caller. function is pickled once to each worker."""
    if workers == 1:
        yield from map(function, batches)
        return
    # spawn, not fork: the parent may run JAX's and the tokenizers' threads
    with concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"),
                                                _start_worker, (function,)) as pool:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_call_worker, batch))
            if len(pending) > 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


_worker_function = None


def _start_worker(function: Callable):
    global _worker_function
    os.environ["TOKENIZERS_PARALLELISM"] = "false"      # the processes are the parallelism
    _worker_function = function


def _call_worker(batch):
    return _worker_function(batch)
