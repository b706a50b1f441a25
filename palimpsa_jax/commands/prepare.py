r"""palimpsa-prepare: local text files to sharded train and validation corpora.

    palimpsa-prepare --input 'docs/**/*.txt' --input data.jsonl --output corpus \
        (--tokenizer tokenizer.json | --train_tokenizer --vocab_size 32000) \
        [--validation_fraction 0.01] [--shard_tokens 100000000] [--workers 8]

Reads plain text (a document per file), JSON Lines and Parquet (a document per record, its field
--text_field), gzip'd or not; writes corpus/train-00000.npy, ..., validation-00000.npy, ..., the
tokenizer and corpus.json (layout: palimpsa_jax.data.prepare), and prints the documents, tokens
and shards of each split and the tokens per second. Train on it with
`--config.data.path='corpus/train-*.npy' --config.data.test_path='corpus/validation-*.npy'
--config.data.tokenizer=corpus/tokenizer.json` and data.eos_id, model.vocab_size from corpus.json.
A bad flag ends it with one line naming the flag. Also `python -m palimpsa_jax.commands.prepare`.
"""
from __future__ import annotations

import os
import shlex
import sys
import time

from absl import flags

from palimpsa_jax.commands import common
from palimpsa_jax.data import prepare
from palimpsa_jax.training.config import ConfigError


def _define_flags():
    flags.DEFINE_multi_string("input", None, "File or glob pattern (`**` recurses) of text, JSON Lines "
                              "(.jsonl) or Parquet files, .gz allowed but for Parquet; repeat for more.")
    flags.DEFINE_string("output", None, "Directory of the corpus.")
    flags.DEFINE_string("tokenizer", None, "Tokenizer to use: a Hugging Face tokenizer.json or a "
                        "SentencePiece .model.")
    flags.DEFINE_string("eos_token", None, "End-of-document token of --tokenizer (default: the first "
                        "known one it has).")
    flags.DEFINE_bool("train_tokenizer", False, "Train a byte-level BPE of --vocab_size ids on the "
                      "training documents instead.")
    flags.DEFINE_integer("vocab_size", None, "Ids of the trained tokenizer (with --train_tokenizer).")
    flags.DEFINE_integer("tokenizer_sample_docs", 100_000, "Train the tokenizer on the first N "
                         "training documents (0: all).")
    flags.DEFINE_string("text_field", "text", "Field (JSON Lines) or column (Parquet) of the text.")
    flags.DEFINE_float("validation_fraction", 0.01, "Fraction of the documents in the validation "
                       "split, chosen by a hash of each document's text.")
    flags.DEFINE_integer("split_seed", 0, "Key of the hash that splits the documents.")
    flags.DEFINE_integer("shard_tokens", 100_000_000, "Most tokens in a shard file (a longer "
                         "document is a shard of its own).")
    flags.DEFINE_integer("workers", min(os.cpu_count() or 1, 8), "Tokenizing processes.")
    flags.DEFINE_bool("overwrite", False, "Replace a corpus already in --output.")
    flags.mark_flags_as_required(["input", "output"])


def _main():
    f = flags.FLAGS
    start = time.perf_counter()
    try:
        corpus = prepare.prepare(
            f.input, f.output, tokenizer=f.tokenizer, eos_token=f.eos_token,
            train_tokenizer=f.train_tokenizer, vocab_size=f.vocab_size,
            tokenizer_sample_docs=f.tokenizer_sample_docs, text_field=f.text_field,
            validation_fraction=f.validation_fraction, split_seed=f.split_seed,
            shard_tokens=f.shard_tokens, workers=f.workers, overwrite=f.overwrite,
            command=shlex.join(sys.argv))
    except ValueError as e:      # a flag or an input file that cannot be used: the message names it
        raise ConfigError(str(e)) from None
    seconds = time.perf_counter() - start
    for split, counts in corpus["splits"].items():
        print(f"{split:>10}: {counts['documents']:>12,} documents {counts['tokens']:>15,} tokens "
              f"{len(counts['shards']):>5} shards")
    dropped = corpus["dropped_documents"]
    print(f"   dropped: {dropped['empty']:,} empty documents, {dropped['containing_eos_id']:,} "
          f"containing eos_id")
    tokens = sum(counts["tokens"] for counts in corpus["splits"].values())
    print(f"{tokens:,} tokens in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s, {f.workers} workers); "
          f"vocab_size {corpus['vocab_size']}, eos_id {corpus['eos_id']}: {f.output}/corpus.json")


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
