"""MQAR with Palimpsa-M (Mamba2 with the metaplastic memory) (SPEC section 5).

    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_m.py --workdir runs/mqar_palimpsa_m
    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_m.py:paper --workdir runs/mqar_palimpsa_m_paper

No argument: the small CPU variant (minutes). `:paper`: sequence 512, 128 pairs, vocabulary 8192.
"""
from palimpsa_jax.training import mqar_config


def get_config(arg=None):
    return mqar_config("palimpsa_m", arg)
