"""Data with grain: MQAR (README "MQAR") and packed text over a local corpus of token ids
(one file or shards; `palimpsa-prepare` makes them from text)."""
from palimpsa_jax.data.loader import make_dataset, mqar_eval_slices
from palimpsa_jax.data.mqar import MQARSource, mqar_example
from palimpsa_jax.data.text import Documents, PackedRows, corpus_files, load_tokens, pack, write_corpus

__all__ = ["make_dataset", "mqar_eval_slices", "MQARSource", "mqar_example", "Documents", "PackedRows",
           "corpus_files", "load_tokens", "pack", "write_corpus"]
