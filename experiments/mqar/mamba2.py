"""MQAR with Mamba2 (SPEC section 5).

    python -m palimpsa_jax.train --config experiments/mqar/mamba2.py --workdir runs/mqar_mamba2
    python -m palimpsa_jax.train --config experiments/mqar/mamba2.py:paper --workdir runs/mqar_mamba2_paper

No argument: the small CPU variant (minutes). `:paper`: sequence 512, 128 pairs, vocabulary 8192.
"""
from palimpsa_jax.training import mqar_config


def get_config(arg=None):
    return mqar_config("mamba2", arg)
