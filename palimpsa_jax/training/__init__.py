"""Training: configs, optimiser, sharded steps, checkpoints, metrics, diagnostics, sweeps.

`train_and_evaluate(config, workdir, resume=False)` runs one experiment; the command line is
`python -m palimpsa_jax.train` (console script `palimpsa-train`).
"""
from palimpsa_jax.training.config import base_config, check_config, model_fields, mqar_config
from palimpsa_jax.training.trainer import Trainer, train_and_evaluate

__all__ = ["Trainer", "base_config", "check_config", "model_fields", "mqar_config",
           "train_and_evaluate"]
