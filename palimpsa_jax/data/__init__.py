"""Data with grain: MQAR (SPEC section 5) and packed text over a local corpus of token ids."""
from palimpsa_jax.data.loader import make_dataset, mqar_eval_slices
from palimpsa_jax.data.mqar import MQARSource, generate
from palimpsa_jax.data.text import Documents, PackedRows, load_tokens, pack, write_corpus

__all__ = ["make_dataset", "mqar_eval_slices", "MQARSource", "generate", "Documents", "PackedRows",
           "load_tokens", "pack", "write_corpus"]
