"""Batched, sharded, checkpointable grain datasets from the `data` part of a config.

Fields read (attribute access on `data`): kind ("mqar" | "text"); mqar: vocab_size, seq_len,
num_pairs, num_train, num_test, power_a, seed (the examples' content; the shuffle order comes
from the `seed` argument), eval_slices (optional list of [seq_len, num_pairs]); text: path
(training corpus), test_path (evaluation corpus, only for split "test"), seq_len, eos_id. A
corpus is a .npy file, a glob of shards (`corpus/train-*.npy`, sorted) or a list of them, read as
one stream (palimpsa_jax.data.text).

Batches are dicts of numpy arrays with leading dim batch_size (per process). shard_index /
shard_count (jax.process_index() / jax.process_count()) give each process every
shard_count-th example (MQAR), document (text training) or row (text evaluation).
- split "train": endless; each shard is shuffled afresh every epoch, deterministically from
  `seed`; batches never mix in padding (text rows are full, a document stream never ends).
- split "test": one pass in order; every shard yields the same number of full batches, the
  missing examples being padding (tokens 0, labels -100, segment_ids 0), so no example is
  dropped and processes stay in step.
`iter(dataset)` is a grain DatasetIterator: get_state() is JSON-serialisable and set_state()
on a fresh iterator continues with exactly the batches that followed.
"""
from __future__ import annotations

import contextlib
import functools

import grain
import numpy as np

from palimpsa_jax.data import text
from palimpsa_jax.data.mqar import IGNORE, MQARSource, check_int

KINDS = ("mqar", "text")


# Elements are read in the calling thread: examples are made in Python under the GIL, where
# grain's reader threads only add contention (measured: 37 ms per MQAR paper batch without
# threads, 66 ms with 2, 100 ms with 4). Parallel reading: `.mp_prefetch()` on the returned dataset.
READ_OPTIONS = grain.ReadOptions(num_threads=0)


def make_dataset(data_config, *, split: str, batch_size: int, seed: int, shard_index: int = 0,
                 shard_count: int = 1) -> grain.IterDataset:
    """This process's batches of `split` ("train" or "test") of the dataset `data_config`."""
    _check_loader_arguments(split, batch_size, shard_index, shard_count)
    check_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"seed must be below 2^32 (got {seed})")
    kind = data_config.kind
    if kind == "mqar":
        source = _mqar_source(data_config, split, data_config.seq_len, data_config.num_pairs, "data.")
        examples = grain.MapDataset.source(source)
        if split == "test":
            return _eval_batches(examples, _mqar_padding(data_config.seq_len), batch_size,
                                 shard_index, shard_count)
        _check_shardable(len(examples), shard_count, "data.num_train")
        return (examples[shard_index::shard_count].shuffle(seed).repeat()
                .to_iter_dataset(READ_OPTIONS).batch(batch_size, drop_remainder=True))
    if kind == "text":
        if split == "test":
            path = getattr(data_config, "test_path", None)
            if not path:
                raise ValueError("data.test_path must name the evaluation corpus for split 'test'")
            with _prefixed("data.", (("path", "test_path"),)):
                rows = grain.MapDataset.source(text.PackedRows(path, data_config.eos_id, data_config.seq_len))
            return _eval_batches(rows, text.padding_row(data_config.seq_len), batch_size,
                                 shard_index, shard_count)
        with _prefixed("data."):
            documents = grain.MapDataset.source(text.Documents(data_config.path, data_config.eos_id))
            stream = (documents[shard_index::shard_count].shuffle(seed).repeat()
                      .to_iter_dataset(READ_OPTIONS))
            rows = text.pack(stream, data_config.seq_len)
        _check_shardable(len(documents), shard_count, "data.path")
        return rows.batch(batch_size, drop_remainder=True)
    raise ValueError(f"data.kind must be one of {KINDS} (got {kind!r})")


def mqar_eval_slices(data_config, *, batch_size: int, shard_index: int = 0,
                     shard_count: int = 1) -> dict[tuple[int, int], grain.IterDataset]:
    """{(seq_len, num_pairs): single-pass test batches of num_test examples} for data.eval_slices.

    Without data.eval_slices the one slice is (data.seq_len, data.num_pairs).
    """
    _check_loader_arguments("test", batch_size, shard_index, shard_count)
    slices = getattr(data_config, "eval_slices", None) or [(data_config.seq_len, data_config.num_pairs)]
    datasets = {}
    for seq_len, num_pairs in slices:
        source = _mqar_source(data_config, "test", seq_len, num_pairs,
                              f"data.eval_slices {[seq_len, num_pairs]}: ")
        datasets[(int(seq_len), int(num_pairs))] = _eval_batches(
            grain.MapDataset.source(source), _mqar_padding(seq_len), batch_size, shard_index, shard_count)
    return datasets


def _check_loader_arguments(split, batch_size, shard_index, shard_count):
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test' (got {split!r})")
    check_int("batch_size", batch_size, 1)
    check_int("shard_count", shard_count, 1)
    check_int("shard_index", shard_index, 0)
    if shard_index >= shard_count:
        raise ValueError(f"shard_index must be below shard_count={shard_count} (got {shard_index})")


def _check_shardable(num_items: int, shard_count: int, name: str):
    if num_items < shard_count:
        raise ValueError(f"{name} gives {num_items} training items, fewer than the {shard_count} shards")


@contextlib.contextmanager
def _prefixed(where: str, renames: tuple[tuple[str, str], ...] = ()):
    """Re-raises a ValueError naming an argument as one naming the config field: where + field."""
    try:
        yield
    except ValueError as error:
        message = str(error)
        for argument, field in renames:
            message = message.replace(argument, field, 1)
        raise ValueError(where + message) from error


def _mqar_source(data_config, split, seq_len, num_pairs, where) -> MQARSource:
    num_key = "num_train" if split == "train" else "num_test"
    with _prefixed(where, (("num_examples", num_key),)):
        return MQARSource(split, getattr(data_config, num_key), data_config.vocab_size, seq_len,
                          num_pairs, data_config.seed, data_config.power_a)


def _mqar_padding(seq_len: int) -> dict[str, np.ndarray]:
    return {"tokens": np.zeros(seq_len, np.int32), "labels": np.full(seq_len, IGNORE, np.int32)}


def _eval_batches(items: grain.MapDataset, padding: dict, batch_size: int, shard_index: int,
                  shard_count: int) -> grain.IterDataset:
    """Shard shard_index of items, padded so every shard has the same number of full batches."""
    per_shard = -(-len(items) // shard_count)
    padded = -(-per_shard // batch_size) * batch_size
    shard = items[shard_index::shard_count]
    return (grain.MapDataset.range(padded).map(functools.partial(_item_or_padding, shard, padding))
            .to_iter_dataset(READ_OPTIONS).batch(batch_size))


def _item_or_padding(shard: grain.MapDataset, padding: dict, index: int) -> dict:
    return shard[index] if index < len(shard) else padding
