"""A tiny trained language-model run for the tests of evaluation, generation and long context.

`text_run(workdir, mixer)` writes a small English-like corpus, trains a byte-level BPE on it,
trains a 2-layer model a few steps through `train_and_evaluate` (so the run has config.json,
tokenizer.json and a checkpoint, as a real run does) and returns the workdir;
`shared_text_run(tmp_path_factory)` builds it once per test process.
"""
from __future__ import annotations

import pathlib

import numpy as np

from palimpsa_jax.data import write_corpus
from palimpsa_jax.data.tokenizer import train_bpe
from palimpsa_jax.experiments.lm import palimpsa_d
from palimpsa_jax.models import ModelConfig
from palimpsa_jax.training import model_fields, train_and_evaluate

WORDS = ("the cat dog sat on a mat ran to house tree big small red blue and then it was very "
         "happy sad one two three quick brown fox jumps over lazy").split()


def sentences(count: int, seed: int) -> list[str]:
    """count short documents of random words (deterministic in seed)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(8, 40))) + "." for _ in range(count)]


def text_run(workdir: pathlib.Path, mixer: str = "palimpsa_d", *, steps: int = 4,
             vocab_size: int = 384) -> pathlib.Path:
    """A run of `steps` steps of a 2-layer `mixer` model on a tiny corpus; returns workdir."""
    data = workdir.parent / f"{workdir.name}_data"
    tokenizer = train_bpe(sentences(400, 0), vocab_size, data / "tokenizer.json")
    for split, seed, count in (("train", 1, 300), ("test", 2, 20)):
        docs = tokenizer.encode_batch(sentences(count, seed))
        write_corpus(data / f"{split}.npy", docs, eos_id=tokenizer.eos_id)
    c = palimpsa_d.get_config()
    c.model = model_fields(ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2,
                                       mixers=(mixer,), num_heads=2, head_dim=16, mlp_hidden=64,
                                       ssm_state=16, ssm_head_dim=16))
    c.data.update(path=str(data / "train.npy"), test_path=str(data / "test.npy"),
                  tokenizer=str(data / "tokenizer.json"), eos_id=tokenizer.eos_id, seq_len=64)
    c.batch_size = 4
    c.train.steps = steps
    c.optim.warmup_steps = 1
    c.checkpoint.update(every_steps=steps, async_save=False)
    c.log.update(every_steps=steps, diagnostics_every_steps=0, progress=False)
    c.eval.update(every_steps=0, batch_size=4)
    train_and_evaluate(c, workdir)
    return workdir


def shared_text_run(tmp_path_factory, mixer: str = "palimpsa_d") -> pathlib.Path:
    """text_run once per test process (in pytest's base temp dir), for every module that needs it."""
    workdir = tmp_path_factory.getbasetemp() / f"text_run_{mixer}"
    return workdir if (workdir / "checkpoints").is_dir() else text_run(workdir, mixer)
