"""palimpsa-prepare: text, JSON Lines and Parquet files to sharded corpora that decode back to the
documents, split by document hash whatever the worker count; sharded corpora read as one stream."""
import gzip
import json
import pathlib
import pickle
import shlex
import subprocess
import tempfile
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st

from palimpsa_jax.data import Documents, PackedRows, corpus_files, load_tokens, make_dataset
from palimpsa_jax.data import prepare as prep
from palimpsa_jax.data.tokenizer import Tokenizer, train_bpe

DOCUMENTS = ["hello world\n", "  leading and trailing spaces  ", "tabs\tand\r\nWindows lines\r\n",
             "ünïcødé ✓ 漢字 𝄞 emoji 🙂", "def f(x):\n    return x * 2\n", "\n\nblank lines around\n\n",
             "a", "long " * 200, *(f"record {i}: {'lorem ipsum ' * (i % 5)}value {i * i}" for i in range(40))]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE (any text round-trips) to prepare with, trained once."""
    return train_bpe(DOCUMENTS, 300, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def write_inputs(directory: pathlib.Path, documents: list[str]) -> list[str]:
    """The documents spread over .txt files (nested), a .txt.gz, a .jsonl, a .jsonl.gz and a
    .parquet (several row groups), in this order; returns the --input patterns."""
    parts = np.array_split(np.arange(len(documents)), 5)
    for i in parts[0]:
        path = directory / "text" / f"sub{i // 4}" / f"doc{i:03d}.txt"   # sorted = in order
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(documents[i].encode())
    with gzip.open(directory / "more.txt.gz", "wt", encoding="utf-8", newline="") as f:
        f.write("".join(documents[i] for i in parts[1]))
    records = lambda part: "".join(json.dumps({"id": int(i), "text": documents[i]}) + "\n" for i in part)
    (directory / "records.jsonl").write_text(records(parts[2]))
    with gzip.open(directory / "records2.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(records(parts[3]))
    pq.write_table(pa.table({"id": parts[4], "text": [documents[i] for i in parts[4]]}),
                   directory / "rows.parquet", row_group_size=3)
    return [str(directory / "text/**/*.txt"), str(directory / "more.txt.gz"), str(directory / "records*.jsonl*"),
            str(directory / "rows.parquet")]


def expected_documents(documents: list[str]) -> list[str]:
    """The documents write_inputs gives (its .txt.gz holds its part as one document)."""
    parts = np.array_split(np.arange(len(documents)), 5)
    return ([documents[i] for i in parts[0]] + ["".join(documents[i] for i in parts[1])]
            + [documents[i] for part in parts[2:] for i in part])


def read_corpus(output: pathlib.Path) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """corpus.json and each split's documents (token ids, eos included), after checking that
    corpus.json's counts, files and dtype are those of the shard arrays."""
    corpus = json.loads((output / "corpus.json").read_text())
    eos_id, documents = corpus["eos_id"], {}
    for split, counts in corpus["splits"].items():
        files = [output / shard["file"] for shard in counts["shards"]]
        assert sorted(output.glob(f"{split}-*.npy")) == files
        for path, shard in zip(files, counts["shards"]):
            tokens = load_tokens(path)
            assert tokens.dtype == corpus["dtype"] and len(tokens) == shard["tokens"] and tokens[-1] == eos_id
            assert np.sum(tokens == eos_id) == shard["documents"]
        assert counts["documents"] == sum(s["documents"] for s in counts["shards"])
        assert counts["tokens"] == sum(s["tokens"] for s in counts["shards"])
        stream = Documents(str(output / f"{split}-*.npy"), eos_id) if files else []
        documents[split] = [stream[i]["tokens"] for i in range(len(stream))]
        assert len(documents[split]) == counts["documents"]
    return corpus, documents


def decoded(tokenizer: Tokenizer, documents: list[np.ndarray]) -> list[str]:
    assert all(d[-1] == tokenizer.eos_id and tokenizer.eos_id not in d[:-1] for d in documents)
    return [tokenizer.decode(d[:-1]) for d in documents]


def check_round_trip(output: pathlib.Path, documents: list[str], validation_fraction: float, seed: int = 0):
    """Each document once, in input order, in the split its hash gives; returns corpus.json."""
    corpus, written = read_corpus(output)
    tokenizer = Tokenizer(output / corpus["tokenizer"], eos_id=corpus["eos_id"])
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (corpus["vocab_size"], corpus["eos_id"])
    for split in prep.SPLITS:
        wanted = [d for d in documents if prep.split_of(d, validation_fraction, seed) == split]
        assert decoded(tokenizer, written[split]) == wanted, split
    return corpus


def test_trained_bpe_round_trip_over_every_format(tmp_path):
    documents = expected_documents(DOCUMENTS)
    output = tmp_path / "corpus"
    corpus = prep.prepare(write_inputs(tmp_path, DOCUMENTS), output, train_tokenizer=True, vocab_size=320,
                          validation_fraction=0.3, shard_tokens=64, workers=1)
    assert corpus == check_round_trip(output, documents, 0.3)
    assert corpus["tokenizer"] == "tokenizer.json" and 257 < corpus["vocab_size"] <= 320 and corpus["dtype"] == "uint16"
    assert all(corpus["splits"][split]["documents"] > 0 for split in prep.SPLITS)
    assert len(corpus["files"]) == len(np.array_split(DOCUMENTS, 5)[0]) + 4   # and .txt.gz, 2 x .jsonl, .parquet
    assert corpus["dropped_documents"] == {"empty": 0, "containing_eos_id": 0}


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> pathlib.Path:
    """A SentencePiece BPE that round-trips text exactly (identity normalization, byte fallback)."""
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(DOCUMENTS), model_prefix=str(prefix), vocab_size=400, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
    return prefix.with_suffix(".model")


def test_sentencepiece_round_trip(tmp_path, sentencepiece_model):
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    output = tmp_path / "corpus"
    corpus = prep.prepare(write_inputs(tmp_path, DOCUMENTS), output, tokenizer=sentencepiece_model,
                          validation_fraction=0.2, split_seed=7, workers=1)
    assert corpus["eos_id"] == processor.eos_id() == 2                   # </s>, SentencePiece's default
    assert corpus["tokenizer"] == "tokenizer.model"
    assert (output / "tokenizer.model").read_bytes() == sentencepiece_model.read_bytes()
    check_round_trip(output, expected_documents(DOCUMENTS), 0.2, seed=7)


def test_split_is_the_same_with_any_worker_count(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr(prep, "_BATCH_CHARS", 100)          # many tasks, finished out of order
    inputs = write_inputs(tmp_path, DOCUMENTS)
    for workers in (1, 3):
        prep.prepare(inputs, tmp_path / f"workers{workers}", tokenizer=bpe.path, validation_fraction=0.25,
                     shard_tokens=100, workers=workers)
    files = sorted(p.name for p in (tmp_path / "workers1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "workers3").iterdir())
    assert all((tmp_path / "workers1" / n).read_bytes() == (tmp_path / "workers3" / n).read_bytes() for n in files)
    check_round_trip(tmp_path / "workers3", expected_documents(DOCUMENTS), 0.25)


@settings(max_examples=15, deadline=None)
@given(documents=st.lists(st.text(max_size=30), min_size=1, max_size=12), shard_tokens=st.integers(1, 40))
def test_shards_hold_whole_documents_within_the_limit(bpe, documents, shard_tokens):
    """Each shard is filled greedily up to shard_tokens (a longer document alone); documents,
    arbitrary text included, come back in order; empty ones are skipped and counted."""
    with tempfile.TemporaryDirectory() as directory:
        directory = pathlib.Path(directory)
        records = "".join(json.dumps({"text": d}) + "\n" for d in documents)
        (directory / "in.jsonl").write_text(records)
        if not any(documents):
            with pytest.raises(ValueError, match="^--input: the files hold no documents"):
                prep.prepare([directory / "in.jsonl"], directory / "out", tokenizer=bpe.path, workers=1)
            return
        corpus = prep.prepare([directory / "in.jsonl"], directory / "out", tokenizer=bpe.path,
                              validation_fraction=0, shard_tokens=shard_tokens, workers=1)
        _, written = read_corpus(directory / "out")
    assert decoded(bpe, written["train"]) == [d for d in documents if d] and written["validation"] == []
    assert corpus["dropped_documents"]["empty"] == documents.count("")
    sizes, start = [len(d) for d in written["train"]], 0
    for shard in corpus["splits"]["train"]["shards"]:
        n = shard["documents"]
        assert shard["tokens"] == sum(sizes[start:start + n])
        assert shard["tokens"] <= shard_tokens or n == 1
        if start + n < len(sizes):                      # the next document did not fit
            assert shard["tokens"] + sizes[start + n] > shard_tokens
        start += n


def test_eos_id_only_ever_ends_a_document(tmp_path, bpe):
    """Text holding the eos token is ordinary text; a document encoding to an eos_token that
    names an ordinary piece is dropped and counted."""
    documents = ["fine", "a <|endoftext|> inside", "", "x"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in documents) + "\n")
    corpus = prep.prepare([tmp_path / "in.jsonl"], tmp_path / "out", tokenizer=bpe.path, text_field="body",
                          validation_fraction=0, workers=1)
    assert corpus["dropped_documents"] == {"empty": 1, "containing_eos_id": 0}
    assert decoded(bpe, read_corpus(tmp_path / "out")[1]["train"]) == ["fine", "a <|endoftext|> inside", "x"]
    corpus = prep.prepare([tmp_path / "in.jsonl"], tmp_path / "out_x", tokenizer=bpe.path, eos_token="x",
                          text_field="body", validation_fraction=0, workers=1)
    x = Tokenizer(bpe.path, eos_token="x").eos_id
    kept = [d for d in documents if d and x not in bpe.encode(d)]
    assert "x" not in kept and "fine" in kept
    assert corpus["dropped_documents"] == {"empty": 1, "containing_eos_id": 3 - len(kept)}
    assert corpus["splits"]["train"]["documents"] == len(kept)


def test_overwrite_replaces_every_earlier_shard(tmp_path, bpe):
    inputs = write_inputs(tmp_path, DOCUMENTS)
    many = prep.prepare(inputs, tmp_path / "out", tokenizer=bpe.path, shard_tokens=50, workers=1)
    with pytest.raises(ValueError, match="^--output .* already holds a corpus .* --overwrite"):
        prep.prepare(inputs, tmp_path / "out", tokenizer=bpe.path, workers=1)
    few = prep.prepare(inputs, tmp_path / "out", tokenizer=bpe.path, overwrite=True, workers=1)
    assert len(many["splits"]["train"]["shards"]) > 1 and len(few["splits"]["train"]["shards"]) == 1
    check_round_trip(tmp_path / "out", expected_documents(DOCUMENTS), 0.01)


# ---------------------------------------------------------------- sharded corpora in the loader


@settings(max_examples=40, deadline=None)
@given(documents=st.lists(st.lists(st.integers(2, 70000), max_size=9), max_size=8), open_end=st.booleans(),
       cuts=st.lists(st.integers(0, 80), max_size=4), seq_len=st.integers(1, 7))
def test_shards_read_as_their_concatenation(documents, open_end, cuts, seq_len):
    """Shards cut anywhere (inside documents, empty ones, mixed dtypes): the same Documents and
    PackedRows as the one concatenated file, also after pickling."""
    eos_id = 1
    stream = np.array([t for d in documents for t in [*d, eos_id]] + ([5, 6] if open_end else []), np.int64)
    bounds = [0, *sorted(min(c, len(stream)) for c in cuts), len(stream)]
    with tempfile.TemporaryDirectory() as directory:
        directory = pathlib.Path(directory)
        np.save(directory / "whole.npy", stream.astype(np.uint32))
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            piece = stream[a:b]
            np.save(directory / f"part-{i:02d}.npy", piece.astype(np.uint16 if np.all(piece < 2**16) else np.int32))
        whole = str(directory / "whole.npy")
        for pattern in (str(directory / "part-*.npy"), sorted(directory.glob("part-*.npy"))):
            for source, reference in ((Documents(pattern, eos_id), Documents(whole, eos_id)),
                                      (PackedRows(pattern, eos_id, seq_len), PackedRows(whole, eos_id, seq_len))):
                copy = pickle.loads(pickle.dumps(source))
                assert len(source) == len(copy) == len(reference)
                for i in range(len(reference)):
                    assert all(np.array_equal(s[i][k], reference[i][k]) for s in (source, copy) for k in reference[i])


def test_make_dataset_reads_shard_globs(tmp_path, bpe):
    prep.prepare(write_inputs(tmp_path, DOCUMENTS), tmp_path / "out", tokenizer=bpe.path, shard_tokens=60,
                 validation_fraction=0.3, workers=1)
    corpus, written = read_corpus(tmp_path / "out")
    np.save(tmp_path / "validation.npy", np.concatenate(written["validation"]))
    config = lambda test_path: types.SimpleNamespace(kind="text", path=str(tmp_path / "out/train-*.npy"),
                                                     test_path=test_path, seq_len=16, eos_id=corpus["eos_id"])
    rows = lambda c: list(make_dataset(c, split="test", batch_size=4, seed=0))
    sharded = rows(config(str(tmp_path / "out/validation-*.npy")))
    single = rows(config(str(tmp_path / "validation.npy")))
    assert len(sharded) == len(single) and all(np.array_equal(a[k], b[k]) for a, b in zip(sharded, single) for k in a)
    train = iter(make_dataset(config(None), split="train", batch_size=2, seed=0))
    tokens = np.concatenate([next(train)["tokens"].reshape(-1)
                             for _ in range(corpus["splits"]["train"]["tokens"] // 32 + 2)])
    first_epoch = np.split(tokens, np.flatnonzero(tokens == corpus["eos_id"]) + 1)[:len(written["train"])]
    assert sorted(map(tuple, first_epoch)) == sorted(map(tuple, written["train"]))


def test_command_line(tmp_path):
    inputs = write_inputs(tmp_path, DOCUMENTS)
    command = ["palimpsa-prepare", *(f"--input={i}" for i in inputs), f"--output={tmp_path / 'corpus'}",
               "--train_tokenizer", "--vocab_size=300", "--validation_fraction=0.25", "--shard_tokens=80",
               "--workers=1"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    corpus = check_round_trip(tmp_path / "corpus", expected_documents(DOCUMENTS), 0.25)
    for split in prep.SPLITS:
        counts = corpus["splits"][split]
        assert f"{split}: {counts['documents']:>12,} documents {counts['tokens']:>15,} tokens" in result.stdout
    assert "tokens/s" in result.stdout and shlex.split(corpus["command"])[1:] == command[1:]
    bad = subprocess.run([*command[:-1], "--workers=0", "--overwrite"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == "error: --workers must be an integer >= 1 (got 0)"


# ---------------------------------------------------------------- errors


def bad_files(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "table.csv").write_text("text\nhello\n")
    (tmp_path / "no_field.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "not_json.jsonl").write_text('{"text": "a"}\n{text: b}\n')
    (tmp_path / "number.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "binary.bin").write_bytes(b"\x93NUMPY\xff\x00")
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "no_column.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "ok.txt").write_text("fine")
    return tmp_path


@pytest.mark.parametrize("inputs, arguments, message", [
    (["missing/*.txt"], {}, r"^--input '.*missing/\*\.txt' matches no file"),
    ([""], {}, "^--input '' matches no file"),
    (["table.csv"], {}, r"^--input file .*table\.csv: \.csv files are not read"),
    (["ok.txt", "no_field.jsonl"], {}, r"^--input file .*no_field\.jsonl: line 2 has no field 'text' \(--text_field\)"),
    (["not_json.jsonl"], {}, r"^--input file .*not_json\.jsonl: line 2 is not JSON"),
    (["number.jsonl"], {}, r"^--input file .*number\.jsonl: line 1: field 'text' \(--text_field\) holds int, not text"),
    (["binary.bin"], {}, r"^--input file .*binary\.bin: not UTF-8 text"),
    (["broken.txt.gz"], {}, r"^--input file .*broken\.txt\.gz: Not a gzipped file"),
    (["no_column.parquet"], {}, r"^--input file .*no_column\.parquet: no column 'text' \(--text_field\)"),
    (["ints.parquet"], {}, r"^--input file .*ints\.parquet: column 'text' \(--text_field\) holds int64"),
    (["ok.txt"], dict(tokenizer=None), "^pass one of --tokenizer"),
    (["ok.txt"], dict(train_tokenizer=True), "^pass one of --tokenizer"),
    (["ok.txt"], dict(tokenizer=None, train_tokenizer=True), "^--vocab_size goes with --train_tokenizer"),
    (["ok.txt"], dict(vocab_size=300), "^--vocab_size goes with --train_tokenizer"),
    (["ok.txt"], dict(tokenizer=None, train_tokenizer=True, vocab_size=100), "^vocab_size must be"),
    (["ok.txt"], dict(tokenizer=None, train_tokenizer=True, vocab_size=300, eos_token="</s>"),
     "^--eos_token goes with --tokenizer"),
    (["ok.txt"], dict(eos_token="<nope>"), "^--tokenizer: tokenizer .* has no token '<nope>'"),
    (["ok.txt"], dict(tokenizer="missing.json"), "^--tokenizer: tokenizer file .*missing.json does not exist"),
    (["ok.txt"], dict(validation_fraction=1.0), r"^--validation_fraction must be in \[0, 1\)"),
    (["ok.txt"], dict(shard_tokens=0), "^--shard_tokens"),
    (["ok.txt"], dict(split_seed=-1), "^--split_seed"),
    (["ok.txt"], dict(text_field=""), "^--text_field"),
    (["ok.txt"], dict(output="ok.txt"), "^--output .*ok.txt is not a directory"),
])
def test_bad_arguments_name_the_flag(tmp_path, bpe, inputs, arguments, message):
    directory = bad_files(tmp_path)
    arguments = {"tokenizer": bpe.path, "output": directory / "out", "workers": 1, **arguments}
    if isinstance(arguments["output"], str):
        arguments["output"] = directory / arguments["output"]
    inputs = [str(directory / i) if i else i for i in inputs]
    with pytest.raises(ValueError, match=message):
        prep.prepare(inputs, **arguments)


def test_loader_and_config_name_the_corpus_key(tmp_path):
    from palimpsa_jax.experiments.lm import palimpsa_d
    from palimpsa_jax.training import ConfigError, check_config

    np.save(tmp_path / "train-00000.npy", np.array([5, 1], np.uint16))
    good, bad = str(tmp_path / "train-*.npy"), str(tmp_path / "nothing-*.npy")
    assert corpus_files([good, tmp_path / "train-00000.npy"]) == [str(tmp_path / "train-00000.npy")] * 2
    text = lambda **paths: types.SimpleNamespace(**{"kind": "text", "seq_len": 4, "eos_id": 1, **paths})
    for config, split, message in ((text(path=bad), "train", "data.path"),
                                   (text(path=good, test_path=bad), "test", "data.test_path")):
        with pytest.raises(ValueError, match=rf"^{message} '.*nothing-\*\.npy' matches no file"):
            make_dataset(config, split=split, batch_size=1, seed=0)
    for key in ("path", "test_path"):
        config = palimpsa_d.get_config()
        config.data.update(path=good, test_path=good)
        config.data[key] = bad
        with pytest.raises(ConfigError, match=rf"^data\.{key} '.*nothing-\*\.npy' matches no file"):
            check_config(config, {"data": 1, "fsdp": 1, "tensor": 1})
