"""MQAR with Palimpsa-D with metaplasticity off (the non-metaplastic baseline on the GLA path).

    palimpsa-train --config experiments/mqar/palimpsa_d_off.py --workdir runs/mqar_palimpsa_d_off
    palimpsa-train --config experiments/mqar/palimpsa_d_off.py:paper --workdir runs/mqar_palimpsa_d_off_paper

No argument: the small CPU job (minutes). `:paper`: the authors' recipe at 512 tokens and 128
pairs (vocabulary 8192, 60 epochs with early stop). Every value is in `common.py` beside this file.
"""
from palimpsa_jax.experiments.mqar import common


def get_config(arg=None):
    return common.get("palimpsa_d_off", arg)
