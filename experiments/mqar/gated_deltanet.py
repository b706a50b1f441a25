"""MQAR with Gated DeltaNet.

    palimpsa-train --config experiments/mqar/gated_deltanet.py --workdir runs/mqar_gated_deltanet
    palimpsa-train --config experiments/mqar/gated_deltanet.py:paper --workdir runs/mqar_gated_deltanet_paper

No argument: the small CPU job (minutes). `:paper`: the authors' recipe at 512 tokens and 128
pairs (vocabulary 8192, 60 epochs with early stop). Every value is in `common.py` beside this file.
"""
from palimpsa_jax.experiments.mqar import common


def get_config(arg=None):
    return common.get("gated_deltanet", arg)
