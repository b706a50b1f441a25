"""Runs that start from given weights (an imported checkpoint, a model after surgery): written at
step 0 so that `palimpsa-train --resume` fine-tunes them and every tool reads them as any run."""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

# workdir/experiment.py: the run's config.json as an experiment file, for palimpsa-train --resume.
EXPERIMENT_FILE = '''"""The config of this run (its config.json), for fine-tuning:

    palimpsa-train --config {workdir}/experiment.py --workdir {workdir} --resume [--config.train.steps=N]
"""
import pathlib

from palimpsa_jax.analysis.run import run_config


def get_config(arg=None):
    return run_config(pathlib.Path(__file__).parent)
'''


def write_warm_start(workdir, config: ml_collections.ConfigDict, model: nnx.Module, *,
                     tokenizer=None) -> pathlib.Path:
    """Writes `model` (a CausalLM of config.model) as a run at step 0 in workdir; returns workdir.

    The run holds config.json, checkpoints/0 (the model's parameters and constants, a fresh
    optimiser state, the data iterator at its start), the tokenizer (a `data.Tokenizer`, copied
    into the run; data.tokenizer and data.eos_id then name it) and experiment.py, with which
    `palimpsa-train --resume` fine-tunes it. The config is checked first (ConfigError naming the
    key); a workdir that already holds a run is a FileExistsError.
    """
    from palimpsa_jax import data
    from palimpsa_jax.training import checkpoint
    from palimpsa_jax.training.trainer import Trainer

    workdir = pathlib.Path(workdir)
    if (workdir / "config.json").exists():
        raise FileExistsError(f"workdir {workdir} already holds a run (config.json)")
    c = ml_collections.ConfigDict(config.to_dict())
    if tokenizer is not None:
        c.data.tokenizer, c.data.eos_id = str(tokenizer.path), tokenizer.eos_id
    trainer = Trainer(c)
    _, params, constants = nnx.split(model, nnx.Param, ...)
    state = {"params": params, "constants": constants, "opt_state": trainer.tx.init(params),
             "step": jnp.zeros((), jnp.int32)}
    batches = iter(data.make_dataset(c.data, split="train", batch_size=c.batch_size // jax.process_count(),
                                     seed=c.seed, shard_index=jax.process_index(),
                                     shard_count=jax.process_count()))
    workdir.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:                  # the run's copy is the one its tools read
        c.data.tokenizer = str(tokenizer.save(workdir).resolve())
    (workdir / "config.json").write_text(json.dumps(json.loads(c.to_json_best_effort()), indent=2) + "\n")
    (workdir / "experiment.py").write_text(EXPERIMENT_FILE.format(workdir=workdir))
    ckpt = checkpoint.Checkpoints(workdir, every_steps=0, keep=1, async_save=False)
    try:
        ckpt.save(0, state, batches.get_state(), force=True)
    finally:
        ckpt.close()
    return workdir
