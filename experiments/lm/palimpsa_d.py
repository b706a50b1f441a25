"""Language modelling with Palimpsa-D on a local corpus of token ids (arXiv 2602.09075).

    palimpsa-train --config experiments/lm/palimpsa_d.py --workdir runs/lm_small \
        --config.data.path=corpus/train.npy --config.data.test_path=corpus/test.npy
    palimpsa-train --config experiments/lm/palimpsa_d.py:170m --workdir runs/lm_170m \
        --config.data.path=fineweb_edu/train.npy --config.data.test_path=fineweb_edu/val.npy

The corpus is a 1-D .npy array of token ids, each document ending with `data.eos_id` (write one
with `palimpsa_jax.data.write_corpus`); nothing is downloaded. Documents are packed into rows of
`data.seq_len` tokens with segment ids, so the memory resets at every document boundary.

No argument: a small CPU model (4 layers, d_model 256, vocabulary 32000, sequences of 256).
`:170m` / `:340m` / `:760m`: the paper's models (Llama-2 vocabulary, sequences of 2048,
0.5M tokens per step, 15B tokens; 30B at 760m) in bfloat16 over float32 master weights. The
optimiser settings are this codebase's choice: the paper gives the data and models, not them.
"""
import ml_collections

from palimpsa_jax.models import ModelConfig, preset
from palimpsa_jax.training import base_config, model_fields

TOKENS = {"170m": 15e9, "340m": 15e9, "760m": 30e9}


def get_config(arg=None):
    c = base_config()
    c.data = ml_collections.ConfigDict(dict(kind="text", path="", test_path="", tokenizer="", eos_id=2,
                                            seq_len=256))
    if arg in (None, ""):
        c.model = model_fields(ModelConfig(vocab_size=32000, d_model=256, n_layers=4,
                                           num_heads=4, head_dim=64, mlp_hidden=768))
        c.batch_size = 16
        c.train.steps = 2000
        c.optim.update(lr=1e-3, warmup_steps=200)
        c.checkpoint.every_steps = 500
        c.log.update(every_steps=20, diagnostics_every_steps=200)
        c.eval.update(every_steps=500, batch_size=16)
    elif arg in TOKENS:
        c.model = model_fields(preset(f"palimpsa_d-{arg}", dtype="bfloat16"))
        c.data.seq_len = 2048
        c.batch_size = 256
        c.train.steps = round(TOKENS[arg] / (c.batch_size * c.data.seq_len))
        c.optim.update(lr=1e-3, warmup_steps=1000, b2=0.95, weight_decay=0.1, min_lr_ratio=0.1)
        c.checkpoint.every_steps = 1000
        c.log.update(every_steps=50, diagnostics_every_steps=1000)
        c.eval.update(every_steps=2000, batch_size=64)
    else:
        raise ValueError(f"config argument must be empty or one of {sorted(TOKENS)}, got {arg!r}")
    return c
