"""A trained run, loaded for analysis: its model with restored parameters, config and step."""
from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

import jax
import ml_collections
from flax import nnx

from palimpsa_jax import sharding
from palimpsa_jax.training import checkpoint, trainer  # the module: training imports analysis


class Run(NamedTuple):
    """model: the CausalLM with the checkpoint's parameters (sharded on the mesh it was loaded
    on); config: the run's ConfigDict, as its config.json holds it; step: the checkpoint's."""
    model: nnx.Module
    config: ml_collections.ConfigDict
    step: int
    workdir: pathlib.Path


def _tuples(value):
    """JSON arrays back to the tuples the config files use (lists cannot be overridden by flags)."""
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return tuple(map(_tuples, value)) if isinstance(value, list) else value


def run_config(workdir) -> ml_collections.ConfigDict:
    """The resolved config a run saved in workdir/config.json (arrays as tuples)."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {workdir} is not a run directory")
    return ml_collections.ConfigDict(_tuples(json.loads(path.read_text())))


def checkpoint_steps(workdir) -> list[int]:
    """The steps of the run's checkpoints, ascending."""
    directory = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if (
        directory.is_dir()) else []


def load_run(workdir, step: int | None = None, *, mesh: dict[str, int] | None = None,
             devices=None) -> Run:
    """The model of the run in `workdir` at its latest (or the given) checkpoint.

    mesh: the mesh to load onto, axis -> size (default: the whole batch over the devices,
    `{"data": -1}`); the checkpoint is resharded onto it, whatever mesh it was written on.
    Raises CheckpointError if the run has no such checkpoint.
    """
    workdir = pathlib.Path(workdir)
    config = run_config(workdir)
    # The loading trainer differs only where the run's batch might not divide the new mesh.
    loading = ml_collections.ConfigDict(config.to_dict())
    loading.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, **(mesh or {})})
    loading.batch_size = loading.eval.batch_size = len(devices or jax.devices())
    loading.train.grad_accum = 1
    loader = trainer.Trainer(loading, devices)
    ckpt = checkpoint.Checkpoints(workdir, every_steps=0, keep=1, async_save=False)
    try:
        with sharding.use_mesh(loader.mesh, loader.rules):
            step, state, _ = ckpt.restore(loader.abstract_state, step)
    finally:
        ckpt.close()
    return Run(loader.model(state), config, int(step), workdir)

