"""MQAR with Palimpsa-D (SPEC sections 3 and 5): the README's default job.

    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_d.py --workdir runs/mqar_palimpsa_d
    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_d.py:paper --workdir runs/mqar_palimpsa_d_paper

No argument: the small CPU variant (minutes). `:paper`: sequence 512, 128 pairs, vocabulary 8192.
"""
from palimpsa_jax.training import mqar_config


def get_config(arg=None):
    return mqar_config("palimpsa_d", arg)
