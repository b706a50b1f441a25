"""MQAR with Gated DeltaNet (SPEC section 5).

    python -m palimpsa_jax.train --config experiments/mqar/gated_deltanet.py --workdir runs/mqar_gated_deltanet
    python -m palimpsa_jax.train --config experiments/mqar/gated_deltanet.py:paper --workdir runs/mqar_gated_deltanet_paper

No argument: the small CPU variant (minutes). `:paper`: sequence 512, 128 pairs, vocabulary 8192.
"""
from palimpsa_jax.training import mqar_config


def get_config(arg=None):
    return mqar_config("gated_deltanet", arg)
