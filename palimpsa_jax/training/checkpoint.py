"""Orbax checkpoints of a run: the train state (params, optimiser state, step; sharded arrays
written by every process) and the data iterator's state (JSON), in workdir/checkpoints/<step>.

Saves are asynchronous (`checkpoint.async_save`); a checkpoint becomes visible only once
complete, so a run killed mid-save resumes from the previous one. Restoring takes the target
shardings, so a checkpoint written on one mesh restores onto any other.
"""
from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, empty or cannot be restored."""


class Checkpoints:
    """Periodic checkpoints of (state, data iterator state) under workdir/checkpoints."""

    def __init__(self, workdir: pathlib.Path, *, every_steps: int, keep: int, async_save: bool):
        self.directory = pathlib.Path(workdir).resolve() / "checkpoints"
        self.every_steps = every_steps
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int, *, force: bool = False) -> bool:
        """Whether `save` at this step writes a checkpoint: step a multiple of every_steps, or force."""
        return force or bool(self.every_steps and step % self.every_steps == 0)

    def save(self, step: int, state, data_state: dict, *, force: bool = False) -> bool:
        """Saves when `due(step, force)`; returns whether it did."""
        if not self.due(step, force=force):
            return False
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

    def restore(self, abstract_state, step: int | None = None):
        """(step, state, data iterator state) of the latest (or given) checkpoint, with the
        shardings of `abstract_state` (a tree of jax.ShapeDtypeStruct with shardings)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.directory}")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} could not be restored "
                                  f"({type(e).__name__}: {e})") from e
        return step, restored.state, restored.data

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are written."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract(tree, shardings):
    """jax.ShapeDtypeStruct leaves of `tree` with the given shardings."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
