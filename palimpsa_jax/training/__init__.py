"""Training: configs, optimiser, sharded steps, checkpoints, metrics, diagnostics, grids.

`train_and_evaluate(config, workdir, resume=False)` runs one experiment; the command line is
`palimpsa-train` (`palimpsa_jax.commands.train`). On SIGTERM a run writes a checkpoint after its
current step and raises `Preempted` (`preemption`).
"""
from palimpsa_jax.training.config import ConfigError, base_config, check_config, model_fields
from palimpsa_jax.training.preemption import Preempted
from palimpsa_jax.training.trainer import Trainer, train_and_evaluate

__all__ = ["ConfigError", "Preempted", "Trainer", "base_config", "check_config", "model_fields",
           "train_and_evaluate"]
