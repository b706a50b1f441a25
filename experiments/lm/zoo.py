"""Small language models of the zoo at equal size and token budget, on a corpus made by
palimpsa-prepare (README "Text to training data"); the argument names the mixer.

    palimpsa-prepare --input 'src/**/*.py' --output corpus --train_tokenizer --vocab_size 8192
    palimpsa-train --config experiments/lm/zoo.py:palimpsa_d --workdir runs/zoo_palimpsa_d \
        --config.data.path='corpus/train-*.npy' --config.data.test_path='corpus/validation-*.npy' \
        --config.data.tokenizer=corpus/tokenizer.json --config.data.eos_id=0

Each model has about 19M parameters (d_model 384, vocabulary 8192, tied embeddings; SwiGLU MLPs
but for Mamba2; layers chosen so the counts land within 4% of each other: Palimpsa-D 8 layers of
8 heads of 48, Gated DeltaNet 7 of 3 heads of 128 with Dv 256, Mamba2 16, Transformer++ 9 of 6
heads of 64) and sees the same 1,000 steps of 32 x 1024 tokens (32.8M tokens), in bfloat16 over
float32 master weights. The optimiser settings are this codebase's choice, the same for all.
"""
import ml_collections

from palimpsa_jax.models import ModelConfig, swiglu_hidden
from palimpsa_jax.training import base_config, model_fields

D_MODEL, VOCAB = 384, 8192
MIXERS = {
    "palimpsa_d": dict(n_layers=8, num_heads=8, head_dim=48),
    "gated_deltanet": dict(n_layers=7, num_heads=3, head_dim=128, expand_v=2),
    "mamba2": dict(n_layers=16),
    "attention": dict(n_layers=9, num_heads=6, head_dim=64),
}


def get_config(arg=None):
    if arg not in MIXERS:
        raise ValueError(f"config argument must be one of {sorted(MIXERS)}, got {arg!r}")
    c = base_config()
    c.data = ml_collections.ConfigDict(dict(kind="text", path="", test_path="", tokenizer="",
                                            eos_id=0, seq_len=1024))
    mlp = {} if arg == "mamba2" else {"mlp_hidden": swiglu_hidden(D_MODEL)}
    c.model = model_fields(ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, mixers=(arg,),
                                       dtype="bfloat16", **mlp, **MIXERS[arg]))
    c.batch_size = 32
    c.train.steps = 1000
    c.optim.update(lr=2e-3, warmup_steps=100, min_lr_ratio=0.1)
    c.checkpoint.every_steps = 500
    c.log.update(every_steps=50, diagnostics_every_steps=0)
    c.eval.update(every_steps=500, batch_size=32)
    return c
