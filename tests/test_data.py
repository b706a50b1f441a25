"""The data layer: MQAR layout, power-law query gaps, seeds, disjoint splits; packed text;
make_dataset batches, sharding and JSON iterator-state round trips."""
import itertools
import json
import math
import pathlib
import pickle
import tempfile
import types

import grain
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from palimpsa_jax.data import (
    Documents,
    MQARSource,
    PackedRows,
    load_tokens,
    make_dataset,
    mqar,
    mqar_eval_slices,
    mqar_example,
    pack,
    write_corpus,
)
from palimpsa_jax.data.mqar import gap_distribution, split_of

EOS = 1


def mqar_config(**overrides):
    fields = dict(kind="mqar", vocab_size=64, seq_len=32, num_pairs=4, num_train=12, num_test=7,
                  power_a=0.01, seed=3, eval_slices=[[32, 4], [48, 6]])
    return types.SimpleNamespace(**{**fields, **overrides})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eleven distinct documents of 0..9 tokens (one empty) as a corpus file."""
    rng = np.random.default_rng(0)
    documents = [list(range(100 * i + 2, 100 * i + 2 + n)) for i, n in enumerate(rng.integers(1, 10, 11))]
    documents[4] = []
    path = write_corpus(tmp_path_factory.mktemp("corpus") / "tokens.npy", documents, eos_id=EOS)
    return path, documents


def text_config(path, **overrides):
    fields = dict(kind="text", path=str(path), test_path=str(path), seq_len=5, eos_id=EOS)
    return types.SimpleNamespace(**{**fields, **overrides})


def key(example):
    return example["tokens"].tobytes()


# ---------------------------------------------------------------- MQAR examples


@given(half=st.integers(2, 40), num_pairs=st.integers(1, 10), extra=st.integers(0, 9),
       seed=st.integers(0, 2**32 - 1), split=st.sampled_from(["train", "test"]), index=st.integers(0, 99))
def test_mqar_layout(half, num_pairs, extra, seed, split, index):
    num_pairs = min(num_pairs, half - 1)
    vocab, seq_len, P = 2 * half, 4 * num_pairs + extra, num_pairs
    example = MQARSource(split, 100, vocab, seq_len, P, seed)[index]
    tokens, labels = example["tokens"], example["labels"]
    assert tokens.shape == labels.shape == (seq_len,)
    assert tokens.dtype == labels.dtype == np.int32

    keys, values = tokens[0:2 * P:2], tokens[1:2 * P:2]
    assert len(set(keys)) == P and np.all((1 <= keys) & (keys < half))
    assert len(set(values)) == P and np.all((half <= values) & (values < vocab))
    assert np.all(labels[:2 * P] == -100)

    queries = 2 * P + np.flatnonzero(tokens[2 * P:])
    assert np.array_equal(np.flatnonzero(labels != -100), queries)
    space = (seq_len - 2 * P) // 2
    assert np.all((queries - 2 * P) % 2 == 0) and np.all(queries < 2 * P + 2 * space)
    assert sorted(tokens[queries]) == sorted(keys)                  # each key queried exactly once
    value_of = dict(zip(keys, values))
    assert all(labels[q] == value_of[tokens[q]] for q in queries)
    rest = np.ones(seq_len, bool)
    rest[:2 * P] = rest[queries] = False
    assert np.all(tokens[rest] == 0) and np.all(labels[rest] == -100)


def query_gaps(example, num_pairs):
    """Gap g >= 1 (in query slots after the pair block) of each key, in pair order: (P,)."""
    tokens = example["tokens"]
    keys = tokens[0:2 * num_pairs:2]
    where = {tokens[q]: q for q in 2 * num_pairs + np.flatnonzero(tokens[2 * num_pairs:])}
    return np.array([(where[k] - 2 * num_pairs) // 2 + 1 for k in keys])


def close_means(a, b, tolerance=4.5):
    """Two-sample z-test on the columns of a (N, K) and b (M, K): every |mean difference| within
    `tolerance` standard errors."""
    se = np.sqrt(a.var(0) / len(a) + b.var(0) / len(b))
    return bool(np.all(np.abs(a.mean(0) - b.mean(0)) <= tolerance * se))


def test_single_query_gap_follows_the_power_law():
    """One pair: its gap is one draw from p(g) ∝ g^(a-1); compare E[log g] and P(g = 1) with the
    exact values; a uniform placement fails the same check."""
    n, seq_len, a = 4000, 128, 0.01
    space = (seq_len - 2) // 2
    rng = np.random.default_rng(0)
    gaps = np.array([query_gaps(mqar_example(rng, vocab_size=16, seq_len=seq_len, num_pairs=1, power_a=a), 1)[0]
                     for _ in range(n)])
    p = gap_distribution(space, a)
    g = np.arange(1, space + 1)
    exact = np.array([np.sum(p * np.log(g)), p[0]])                          # E[log g], P(g = 1)
    exact_sd = np.sqrt([np.sum(p * np.log(g) ** 2) - exact[0] ** 2, p[0] * (1 - p[0])])

    def matches(samples):
        stats = np.stack([np.log(samples), samples == 1], 1)
        return bool(np.all(np.abs(stats.mean(0) - exact) <= 4.5 * exact_sd / math.sqrt(len(samples))))

    assert np.isclose(p[0] / p[9], 10 ** (1 - a)) and np.isclose(p.sum(), 1)
    assert matches(gaps)
    assert not matches(rng.integers(1, space + 1, n))


def test_query_gaps_are_successive_power_law_draws():
    """Many pairs: the gap of each key (key i = draw i) matches Zoology's sampler,
    numpy's choice(replace=False, p), draw by draw; uniform slots without replacement do not."""
    n, seq_len, P, a = 3000, 64, 8, 0.01
    space = (seq_len - 2 * P) // 2
    rng = np.random.default_rng(1)
    ours = np.log([query_gaps(mqar_example(rng, vocab_size=64, seq_len=seq_len, num_pairs=P, power_a=a), P)
                   for _ in range(n)])
    p = gap_distribution(space, a)
    zoology = np.log([1 + rng.choice(space, P, replace=False, p=p) for _ in range(n)])
    uniform = np.log([1 + rng.choice(space, P, replace=False) for _ in range(n)])
    assert close_means(ours, zoology)
    assert not close_means(uniform, zoology)


def test_seeds_reproduce_and_differ():
    one, same = MQARSource("train", 50, 64, 32, 4, seed=7), MQARSource("train", 50, 64, 32, 4, seed=7)
    other = MQARSource("train", 50, 64, 32, 4, seed=8)
    for i in (5, 3, 49, 0):                                    # random access, any order
        assert all(np.array_equal(one[i][k], same[i][k]) for k in ("tokens", "labels"))
    assert sum(key(one[i]) != key(other[i]) for i in range(50)) >= 45
    assert len({key(one[i]) for i in range(50)}) == 50


def test_train_and_test_are_disjoint_by_construction():
    """vocab 8, one pair, seq_len 4: only 3 keys x 4 values = 12 sequences exist, so 200
    examples per split collide heavily within a split, yet never across splits."""
    train = {key(MQARSource("train", 200, 8, 4, 1, seed=0)[i]) for i in range(200)}
    test = {key(MQARSource("test", 200, 8, 4, 1, seed=0)[i]) for i in range(200)}
    assert train.isdisjoint(test)
    assert len(train) >= 4 and len(test) >= 4 and len(train | test) <= 12
    assert all(split_of(np.frombuffer(t, np.int32)[:2]) == 0 for t in train)


@pytest.mark.parametrize("split", ["train", "test"])
def test_source_example_is_mqar_example_at_the_first_accepted_attempt(split):
    source = MQARSource(split, 20, 64, 32, 4, seed=11)
    for i in range(20):
        for attempt in itertools.count():
            example = mqar_example(np.random.default_rng([11, source.split_id, i, attempt]),
                               vocab_size=64, seq_len=32, num_pairs=4)
            if split_of(example["tokens"][:8]) == source.split_id:
                break
        assert key(example) == key(source[i]) and np.array_equal(example["labels"], source[i]["labels"])


def test_a_split_without_examples_raises(monkeypatch):
    monkeypatch.setattr(mqar, "split_of", lambda block: 1)       # every pair block hashes to "test"
    assert len(MQARSource("test", 1, 64, 32, 4, seed=0)[0]["tokens"]) == 32
    with pytest.raises(ValueError, match="too few distinct"):
        MQARSource("train", 1, 64, 32, 4, seed=0)[0]


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_pairs=0), "num_pairs"), (dict(num_pairs=2.0), "num_pairs"),
    (dict(vocab_size=65), "vocab_size"), (dict(vocab_size=8), "vocab_size"),
    (dict(vocab_size=True), "vocab_size"), (dict(seq_len=15), "seq_len"),
    (dict(power_a=0.0), "power_a"), (dict(power_a=-1.0), "power_a"), (dict(power_a=float("nan")), "power_a"),
])
def test_mqar_example_argument_errors(kwargs, name):
    settings = {**dict(vocab_size=64, seq_len=16, num_pairs=4, power_a=0.01), **kwargs}
    with pytest.raises(ValueError, match=f"^{name}"):
        mqar_example(np.random.default_rng(0), **settings)
    with pytest.raises(ValueError, match=f"^{name}"):
        MQARSource("train", 10, seed=0, **settings)


def test_source_argument_errors():
    for args, name in [(("valid", 10, 64, 16, 4, 0), "split"), (("train", -1, 64, 16, 4, 0), "num_examples"),
                       (("train", 10, 64, 16, 4, -3), "seed")]:
        with pytest.raises(ValueError, match=f"^{name}"):
            MQARSource(*args)
    source = MQARSource("test", 10, 64, 16, 4, 0)
    assert len(source) == 10
    for index in (10, -1):
        with pytest.raises(IndexError):
            source[index]


# ---------------------------------------------------------------- packed text


documents_strategy = st.lists(st.lists(st.integers(2, 60000), max_size=12), max_size=8)


@given(documents=documents_strategy, seq_len=st.integers(1, 7))
def test_packing(documents, seq_len):
    with tempfile.TemporaryDirectory() as directory:
        path = write_corpus(pathlib.Path(directory) / "c.npy", documents, eos_id=EOS)
        corpus = np.array(load_tokens(path))
        rows = list(pack(grain.MapDataset.source(Documents(path, EOS)).to_iter_dataset(), seq_len))
        in_order = PackedRows(path, EOS, seq_len)
        assert len(in_order) == len(rows)
        for row, other in zip(rows, in_order):
            assert all(np.array_equal(row[k], other[k]) for k in ("tokens", "labels", "segment_ids"))

    streams = [d + [EOS] for d in documents]
    assert np.array_equal(corpus, list(itertools.chain(*streams)))
    assert all(r[k].shape == (seq_len,) and r[k].dtype == np.int32 for r in rows for k in r)
    tokens, labels, segments = (np.concatenate([r[k] for r in rows] or [np.zeros(0, np.int32)])
                                for k in ("tokens", "labels", "segment_ids"))
    real = segments > 0
    assert np.array_equal(tokens[real], corpus)                     # the corpus, in order
    assert np.all(tokens[~real] == 0) and np.all(labels[~real] == -100)
    assert not np.any(real[:-seq_len] == 0) and np.all(np.diff(real.astype(int)) <= 0)   # padding last
    assert np.array_equal(labels[real], list(itertools.chain(*(s[1:] + [-100] for s in streams))))
    for row in rows:
        seg, tok = row["segment_ids"], row["tokens"]
        n = int(np.sum(seg > 0))
        new_document = tok[:n - 1] == EOS                           # the previous token ended one
        assert seg[0] == 1 and np.array_equal(np.diff(seg[:n]), new_document)


def test_corpus_files(tmp_path):
    small = write_corpus(tmp_path / "small.npy", [[2, 65535 - 1]], eos_id=65535)
    large = write_corpus(tmp_path / "large.npy", [[2, 70000]], eos_id=EOS)
    assert load_tokens(small).dtype == np.uint16 and load_tokens(large).dtype == np.uint32
    assert isinstance(load_tokens(large), np.memmap)
    for bad in ([[3, EOS]], [[-2]], [[2**31]]):
        with pytest.raises(ValueError, match=r"^documents\[0\]"):
            write_corpus(tmp_path / "bad.npy", bad, eos_id=EOS)
    np.save(tmp_path / "matrix.npy", np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="^path"):
        load_tokens(tmp_path / "matrix.npy")
    np.save(tmp_path / "open.npy", np.array([5, EOS, 6, 7], np.int32))    # last document unterminated
    documents = Documents(tmp_path / "open.npy", EOS)
    assert len(documents) == 2
    assert documents[1]["tokens"].tolist() == [6, 7] and documents[1]["labels"].tolist() == [7, -100]
    with pytest.raises(IndexError):
        PackedRows(tmp_path / "open.npy", EOS, 3)[2]


def test_sources_pickle_as_their_path(tmp_path):
    path = write_corpus(tmp_path / "big.npy", [list(range(2, 50000))] * 4, eos_id=EOS)
    for source in (Documents(path, EOS), PackedRows(path, EOS, 7)):
        data = pickle.dumps(source)
        assert len(data) < 2000
        copy = pickle.loads(data)
        assert all(isinstance(shard, np.memmap) for shard in copy.shards) and len(copy) == len(source)
        assert all(np.array_equal(copy[2][k], source[2][k]) for k in source[2])


def split_documents(tokens):
    """Token stream -> tuple of documents, each ending at an EOS (a trailing piece dropped)."""
    ends = np.flatnonzero(tokens == EOS) + 1
    return [tuple(d) for d in np.split(tokens, ends)[:-1]]


def test_text_training_stream(corpus):
    """Endless full rows; each epoch is the corpus's documents in a new order."""
    path, documents = corpus
    n = len(documents)
    batches = list(itertools.islice(make_dataset(text_config(path), split="train", batch_size=2, seed=0), 20))
    assert all(b["tokens"].shape == (2, 5) and np.all(b["segment_ids"] > 0) for b in batches)
    stream = split_documents(np.concatenate([b["tokens"].reshape(-1) for b in batches]))
    assert len(stream) >= 2 * n
    wanted = sorted(tuple(d + [EOS]) for d in documents)
    assert sorted(stream[:n]) == sorted(stream[n:2 * n]) == wanted
    assert stream[:n] != stream[n:2 * n]


# ---------------------------------------------------------------- loader


def take(dataset, n=None, state=None):
    iterator = iter(dataset)
    if state is not None:
        iterator.set_state(state)
    return list(itertools.islice(iterator, n))


def same_batches(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("kind, split", [("mqar", "train"), ("mqar", "test"), ("text", "train"),
                                         ("text", "test")])
def test_iterator_state_round_trip(corpus, kind, split):
    """State after n batches, through JSON, restored into a fresh iterator: same next batches."""
    config = mqar_config() if kind == "mqar" else text_config(corpus[0], seq_len=3)
    dataset = make_dataset(config, split=split, batch_size=2, seed=5)
    empty_remainder = False
    for n in range(8):
        iterator = iter(dataset)
        for _ in itertools.islice(iterator, n):
            pass
        state = json.loads(json.dumps(iterator.get_state()))
        empty_remainder |= state.get("remainder_slices", {}).get("tokens") == [-1, -1] and n > 0
        following = list(itertools.islice(iterator, 4))
        assert same_batches(take(dataset, 4, state), following)
    assert empty_remainder or (kind, split) != ("text", "train")   # grain's JSON pitfall was hit


def test_mqar_batches_and_training_shards():
    config = mqar_config()
    whole = take(make_dataset(config, split="train", batch_size=2, seed=1), 12)     # 2 epochs of 12
    assert all(b["tokens"].shape == b["labels"].shape == (2, 32) for b in whole)
    epoch = [{t.tobytes() for b in batches for t in b["tokens"]} for batches in (whole[:6], whole[6:])]
    assert epoch[0] == epoch[1] and len(epoch[0]) == 12
    assert not same_batches(whole[:6], whole[6:])                                   # reshuffled
    assert same_batches(whole, take(make_dataset(config, split="train", batch_size=2, seed=1), 12))
    assert not same_batches(whole, take(make_dataset(config, split="train", batch_size=2, seed=2), 12))
    shards = [{t.tobytes() for b in take(make_dataset(config, split="train", batch_size=2, seed=1,
                                                      shard_index=s, shard_count=2), 3) for t in b["tokens"]}
              for s in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 6
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == epoch[0]


def real_examples(batches):
    """Rows of the batches that are not padding, as bytes (padding: no segment, or no label)."""
    return [b["tokens"][i].tobytes() for b in batches for i in range(len(b["tokens"]))
            if (np.any(b["segment_ids"][i] > 0) if "segment_ids" in b else np.any(b["labels"][i] != -100))]


@pytest.mark.parametrize("kind", ["mqar", "text"])
def test_evaluation_shards(corpus, kind):
    """One pass; every shard has the same number of full batches; shards are disjoint and
    together hold exactly the unsharded examples."""
    config = mqar_config() if kind == "mqar" else text_config(corpus[0], seq_len=4)
    whole = take(make_dataset(config, split="test", batch_size=3, seed=0))
    expected = 7 if kind == "mqar" else len(PackedRows(corpus[0], EOS, 4))
    assert len(real_examples(whole)) == expected and len(whole) == math.ceil(expected / 3)
    shards = [take(make_dataset(config, split="test", batch_size=3, seed=0, shard_index=s, shard_count=2))
              for s in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == math.ceil(math.ceil(expected / 2) / 3)
    assert all(v.shape[0] == 3 for batches in shards for b in batches for v in b.values())
    parts = [real_examples(batches) for batches in shards]
    assert set(parts[0]).isdisjoint(parts[1]) and sorted(parts[0] + parts[1]) == sorted(real_examples(whole))


def test_text_training_shards(corpus):
    path, documents = corpus
    epochs = []
    for s in (0, 1):
        batches = take(make_dataset(text_config(path), split="train", batch_size=2, seed=0,
                                    shard_index=s, shard_count=2), 10)
        stream = split_documents(np.concatenate([b["tokens"].reshape(-1) for b in batches]))
        epochs.append(set(stream[:len(documents[s::2])]))
    assert epochs[0].isdisjoint(epochs[1])
    assert epochs[0] | epochs[1] == {tuple(d + [EOS]) for d in documents}


def test_mqar_eval_slices():
    config = mqar_config()
    slices = mqar_eval_slices(config, batch_size=4)
    assert list(slices) == [(32, 4), (48, 6)]
    for (seq_len, num_pairs), dataset in slices.items():
        batches = take(dataset)
        assert len(batches) == 2 and all(b["tokens"].shape == (4, seq_len) for b in batches)
        labels = np.concatenate([b["labels"] for b in batches])
        assert np.array_equal(np.sum(labels != -100, 1), [num_pairs] * 7 + [0])
    main = take(make_dataset(config, split="test", batch_size=4, seed=0))
    assert same_batches(main, take(slices[(32, 4)]))
    default = mqar_eval_slices(mqar_config(eval_slices=None), batch_size=4)
    assert list(default) == [(32, 4)]
    with pytest.raises(ValueError, match=r"^data\.eval_slices \[40, 11\]: seq_len"):
        mqar_eval_slices(mqar_config(eval_slices=[[40, 11]]), batch_size=4)


@pytest.mark.parametrize("config, kwargs, message", [
    (mqar_config(kind="images"), {}, r"^data\.kind"),
    (mqar_config(vocab_size=63), {}, r"^data\.vocab_size"),
    (mqar_config(num_train=-1), {}, r"^data\.num_train"),
    (mqar_config(num_test=-1), dict(split="test"), r"^data\.num_test"),
    (mqar_config(power_a=0), {}, r"^data\.power_a"),
    (mqar_config(num_train=1), dict(shard_count=2), r"^data\.num_train"),
    (mqar_config(), dict(split="validation"), "^split"),
    (mqar_config(), dict(batch_size=0), "^batch_size"),
    (mqar_config(), dict(shard_index=2, shard_count=2), "^shard_index"),
    (mqar_config(), dict(shard_count=0), "^shard_count"),
    (mqar_config(), dict(seed=-1), "^seed"), (mqar_config(), dict(seed=2**32), "^seed"),
    (types.SimpleNamespace(kind="text", path="x", seq_len=4, eos_id=1), dict(split="test"),
     r"^data\.test_path"),
])
def test_make_dataset_errors(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_dataset(config, **{**dict(split="train", batch_size=2, seed=0), **kwargs})


def test_text_errors(tmp_path):
    path = write_corpus(tmp_path / "one.npy", [[2, 3]], eos_id=EOS)
    with pytest.raises(ValueError, match=r"^data\.path"):
        make_dataset(text_config(path), split="train", batch_size=2, seed=0, shard_count=2)
    for bad in (dict(seq_len=0), dict(eos_id=-1)):
        for split in ("train", "test"):
            with pytest.raises(ValueError, match=rf"^data\.{next(iter(bad))}"):
                make_dataset(text_config(path, **bad), split=split, batch_size=2, seed=0)
