"""MQAR with Palimpsa-D with metaplasticity off (the non-metaplastic baseline on the GLA path) (SPEC section 5).

    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_d_off.py --workdir runs/mqar_palimpsa_d_off
    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_d_off.py:paper --workdir runs/mqar_palimpsa_d_off_paper

No argument: the small CPU variant (minutes). `:paper`: sequence 512, 128 pairs, vocabulary 8192.
"""
from palimpsa_jax.training import mqar_config


def get_config(arg=None):
    return mqar_config("palimpsa_d", arg, metaplasticity=False)
