"""A clean stop on SIGTERM: a preemption notice, a scheduler's time limit, `timeout`.

The training loops (`train_and_evaluate`, `replicas.train_group`) run inside `StopOnSigterm()`
and ask `requested(step)` after every step. Once it is true they write a checkpoint at that step
and raise `Preempted`, so a stopped run loses no steps: `palimpsa-train --resume` (or the same
`palimpsa-sweep` command) continues from there, step for step as if never stopped. The command
lines exit with status 143 (128 + SIGTERM, what a shell reports for a process that SIGTERM
ended), so a job script can tell a stopped run from a finished one (status 0).

In one process a SIGTERM handler sets a flag; it is installed only from the main thread, and
the previous handler is restored when the loop ends. In a multi-process run the processes must
stop at the same step: there JAX's preemption service decides it
(`multihost_utils.reached_preemption_sync_point`, fed by the SIGTERM notifier that
`jax.distributed.initialize` installs), and no handler of ours is installed.
"""
from __future__ import annotations

import pathlib
import signal
import threading

import jax
from jax.experimental import multihost_utils

EXIT_STATUS = 128 + signal.SIGTERM


class Preempted(Exception):
    """A run stopped by SIGTERM after writing its checkpoint of `step` in `directory`."""

    def __init__(self, step: int, directory: pathlib.Path):
        super().__init__(f"SIGTERM after step {step}: checkpoint written in {directory}; the "
                         f"same command (palimpsa-train: with --resume) continues the run")
        self.step, self.directory = step, directory


class StopOnSigterm:
    """Context manager around a training loop: `requested(step)` says whether to stop after
    `step` (every process gets the same answer at the same step)."""

    def __init__(self):
        self.received = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> StopOnSigterm:
        self.received = False
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._previous = signal.SIG_DFL if self._previous is None else self._previous
        return self

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
