"""Training: configs, optimiser, sharded steps, checkpoints, metrics, diagnostics, grids.

`train_and_evaluate(config, workdir, resume=False)` runs one experiment; the command line is
`palimpsa-train` (`palimpsa_jax.commands.train`).
"""
from palimpsa_jax.training.config import ConfigError, base_config, check_config, model_fields
from palimpsa_jax.training.trainer import Trainer, train_and_evaluate

__all__ = ["ConfigError", "Trainer", "base_config", "check_config", "model_fields",
           "train_and_evaluate"]
