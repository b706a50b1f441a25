"""MQAR (multi-query associative recall): the values of every MQAR experiment in this folder.

`paper(mixer, ...)` is the authors' recipe (arXiv 2602.09075; read from their public code,
github.com/djo1996/Palimpsa, as the README's "MQAR" section lists it); `cpu(mixer)` the small
job that runs on two CPU cores in minutes (the README's default job; its optimiser adds
clipping and a warmup to the recipe's, see there). Every value either run
uses is set here or in `palimpsa_jax.training.config.base_config` (the defaults), so a reader of
an experiment file reaches all of them within this folder.

Where this codebase cannot do an item of the recipe exactly, it says so beside it:
- the authors cast the whole model to bfloat16; here parameters and optimiser state are float32
  and the compute (activations, matmuls) is bfloat16 (`model.dtype`), the recurrences
  accumulating in float32;
- their DataLoader reshuffles each epoch and ends it with a short batch (782 batches of 128
  from 100,000 examples); here batches are always full and reshuffled per pass over the data,
  so an "epoch" is 782 steps (100,096 examples) and its boundary falls inside a pass;
- their seeds 1-8 seed PyTorch; here `seed` seeds the parameters and the data order, while the
  examples come from `data.seed`, fixed, so every seed sees the same 100k training examples.
"""
import math

import ml_collections
import numpy as np

from palimpsa_jax.models import ModelConfig
from palimpsa_jax.training import base_config, model_fields

MIXERS = ("palimpsa_d", "palimpsa_d_off", "palimpsa_m", "mamba2", "gated_deltanet")

D_MODEL = 128
INIT_STD = D_MODEL**-0.5            # every Linear, Conv1d and the tied embedding: N(0, 0.0884)


def model(mixer: str, vocab_size: int) -> ModelConfig:
    """The authors' MQAR model of `mixer` (one of MIXERS): d_model 128, 2 layers, no MLP."""
    common = dict(
        vocab_size=vocab_size, d_model=D_MODEL, n_layers=2, mlp_hidden=0, tie_embeddings=True,
        final_norm="layernorm",                                   # their final norm
        beta_rank=D_MODEL // 16,                                  # 8
        # "small forgetting": A_h = linspace(0.01, 0.16, H), dt_h from 0.1 down to 0.001,
        # memory windows of 600-6,000 tokens at initialisation (the LM init gives ~14)
        forget_init="ramp", a_min=0.01, a_max=0.16, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4,
        init_std=INIT_STD, conv_init_std=INIT_STD)
    if mixer in ("palimpsa_d", "palimpsa_d_off", "gated_deltanet"):
        name = "gated_deltanet" if mixer == "gated_deltanet" else "palimpsa_d"
        return ModelConfig(mixers=(name,), num_heads=8, head_dim=16, expand_v=2,
                           metaplasticity=mixer != "palimpsa_d_off", **common)
    if mixer in ("palimpsa_m", "mamba2"):
        # 8 heads of 32 (expand 2), state 16 in 8 groups; in/out projections with bias, conv without
        return ModelConfig(mixers=(mixer,), ssm_head_dim=32, ssm_state=16, ssm_groups=8,
                           ssm_expand=2, ssm_bias=True, ssm_conv_bias=False, **common)
    raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")


def _mqar_data(vocab_size: int, seq_len: int, num_pairs: int, num_train: int, num_test: int,
               eval_slices) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="mqar", vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs,
        num_train=num_train, num_test=num_test, power_a=0.01,   # query gaps p(g) ∝ g^(a-1)
        seed=0, eval_slices=tuple(eval_slices)))               # seed: of the examples


PAPER_LRS = tuple(float(x) for x in np.logspace(np.log10(1e-3), np.log10(1e-2), 4))
PAPER_SETTINGS = ((512, 128, 128), (1024, 256, 64))    # (sequence length, pairs, batch size)
PAPER_EPOCHS = 60
PAPER_SEEDS = tuple(range(1, 9))


def paper(mixer: str, seq_len: int = 512, num_pairs: int = 128, batch_size: int = 128,
          lr: float = PAPER_LRS[1], seed: int = 1, epochs: int = PAPER_EPOCHS
          ) -> ml_collections.ConfigDict:
    """The authors' recipe at one point of their sweep (defaults: 512 tokens, 128 pairs, their
    60 epochs; fewer epochs shorten the cosine, still stepped once an epoch)."""
    c = base_config()
    c.seed = seed
    c.model = model_fields(model(mixer, vocab_size=8192).replace(dtype="bfloat16"))
    c.data = _mqar_data(8192, seq_len, num_pairs, num_train=100_000, num_test=3_000,
                        eval_slices=[(seq_len, num_pairs)])
    c.batch_size = batch_size
    epoch = math.ceil(c.data.num_train / batch_size)        # 782 steps at batch 128
    c.train.steps = epochs * epoch
    c.train.early_stop_accuracy = 0.99                       # stop once test accuracy > 0.99
    c.optim.update(
        lr=lr, b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.1, decay_every_parameter=True,        # AdamW on every parameter
        clip_norm=0.0, warmup_steps=0,                       # no clipping, no warmup
        schedule="cosine", min_lr_ratio=0.0,                 # cosine over 60 epochs ...
        schedule_every_steps=epoch)                          # ... stepped once per epoch
    c.eval.update(every_steps=epoch, batch_size=250)         # evaluation every epoch
    c.checkpoint.every_steps = epoch
    c.log.update(every_steps=100, diagnostics_every_steps=epoch)
    return c


def cpu(mixer: str) -> ml_collections.ConfigDict:
    """The small CPU job: the authors' model on 4 pairs in 32 tokens (vocabulary 128),
    evaluated at that length and at twice it (64 tokens, 8 pairs).

    Batch 32 for 1,000 steps (32,000 examples) at lr 1e-2: 9-11 minutes measured on this
    project's 2-core machine, about 6 on two cores of the H200 host (README "Quickstart").
    It departs from the recipe's optimiser in two places, both chosen by measurement: gradient
    clipping at norm 1 and a 50-step linear warmup. The task has a plateau at accuracy 1/4 (the
    model recalls the values in the sequence but not which key they belong to) that a run leaves
    after a seed-dependent number of steps; the job is sized so that every seed leaves it well
    before the end. Measured on one H200 (float32, `cpu_seeds.py`, seeds 0-7, one vmapped
    program): at lr 1e-2 every seed crossed 0.9 by step 450 and ended at 0.998-1.000 (0.946-0.984
    at 64 tokens / 8 pairs), at lr 6e-3 0.991-1.000, at 3e-3 0.809-1.000; the launcher's runs
    (16, three platforms) ended at 0.93-1.00. The 64-token job this replaced (4 pairs, batch 32,
    500 steps, no clipping) ended at 0.24-0.99 over the same seeds and learning rates; with
    clipping and warmup, batch 64, width 256 or init std 0.02 some seed still ended below 0.9,
    and batch 16 for 1,000 steps (0.92-1.00 at lr 4e-3) costs about twice this job's CPU time
    (`benchmarks/RESULTS.md`). Chunks of 8: the chunked XLA kernel's fastest on two CPU cores
    here (0.36 s a step against 0.39 s at 16 and 0.52 s at 32).
    """
    c = base_config()
    c.seed = 0
    c.model = model_fields(model(mixer, vocab_size=128).replace(chunk_size=8))
    c.data = _mqar_data(128, 32, 4, num_train=100_000, num_test=1_000,
                        eval_slices=[(32, 4), (64, 8)])
    c.batch_size = 32
    c.train.steps = 1000
    c.optim.update(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
                   decay_every_parameter=True, clip_norm=1.0, warmup_steps=50,
                   schedule="cosine", min_lr_ratio=0.0)
    c.checkpoint.every_steps = 100
    c.log.update(every_steps=10, diagnostics_every_steps=100)
    c.eval.update(every_steps=250, batch_size=200)
    return c


def get(mixer: str, arg: str | None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of the per-mixer files: None / "" the CPU job, "paper" the recipe."""
    if arg in (None, ""):
        return cpu(mixer)
    if arg == "paper":
        return paper(mixer)
    raise ValueError(f"config argument must be empty or 'paper', got {arg!r}")
