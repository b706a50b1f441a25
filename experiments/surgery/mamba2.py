"""Fine-tuning after metaplastic surgery (arXiv 2602.09075): a pretrained Mamba2 whose chosen
layers became Palimpsa-M (`palimpsa-surgery`, README "Metaplastic surgery").

    palimpsa-surgery --from mamba2-130m --workdir runs/meta_130m --layers weakest:6 \
        --probe corpus/validation.npy --config experiments/surgery/mamba2.py \
        --config.data.path=corpus/train.npy --config.data.test_path=corpus/validation.npy
    palimpsa-train --config runs/meta_130m/experiment.py --workdir runs/meta_130m --resume

The model is the source's (size, layers, state, tokenizer): `model` holds only what the
checkpoint does not fix, the converted layers' memory (beta_rank, prior_family, learn_prior,
beta_rule) and the run's computation (backend, chunk_size, dtype). The fresh beta projections
learn at optim.metaplastic_lr, the pretrained backbone at the lower optim.lr. The paper states
its fine-tuning hyperparameters for the 2.7B model nowhere this codebase could read (neither
../shared/SPEC.md nor the authors' code), so these are this codebase's choice.

No argument: the public state-spaces checkpoints (GPT-NeoX tokenizer, end of text = 0), 2,000
steps of 64 x 2048 tokens (262M tokens). `:zoo`: the in-small claim of benchmarks/RESULTS.md,
the 16-layer Mamba2 of experiments/lm/zoo.py:mamba2 fine-tuned 300 steps of 32 x 1024 tokens.
"""
import ml_collections

from palimpsa_jax.training import base_config

SETTINGS = {
    None: dict(seq_len=2048, batch_size=64, steps=2000, lr=1e-4, metaplastic_lr=1e-3, warmup_steps=100),
    "zoo": dict(seq_len=1024, batch_size=32, steps=300, lr=4e-4, metaplastic_lr=2e-3, warmup_steps=30),
}


def get_config(arg=None):
    arg = arg or None
    if arg not in SETTINGS:
        raise ValueError(f"config argument must be empty or 'zoo', got {arg!r}")
    s = SETTINGS[arg]
    c = base_config()
    c.data = ml_collections.ConfigDict(dict(kind="text", path="", test_path="", tokenizer="", eos_id=0,
                                            seq_len=s["seq_len"]))
    c.model = ml_collections.ConfigDict(dict(
        beta_rank=32, prior_family="head", learn_prior=False, beta_rule="low_rank", backend="auto",
        chunk_size=ml_collections.FieldReference(None, field_type=int), dtype="bfloat16"))
    c.batch_size = s["batch_size"]
    c.train.steps = s["steps"]
    c.optim.update(lr=s["lr"], metaplastic_lr=s["metaplastic_lr"], warmup_steps=s["warmup_steps"],
                   min_lr_ratio=0.1)
    c.checkpoint.every_steps = 500
    c.log.update(every_steps=50, diagnostics_every_steps=0)
    c.eval.update(every_steps=s["steps"], batch_size=32)
    return c
