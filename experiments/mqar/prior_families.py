"""Prior families on MQAR: the prior precision of Palimpsa-D learned per head, per value row or
per synapse, against the fixed per-head prior (I_prior = 1), on the CPU job of `common.py`,
each over seeds 0-2 (a family's three seeds train together as one vmapped program).

    palimpsa-sweep --config experiments/mqar/prior_families.py --workdir runs/mqar_priors
    palimpsa-analyze --workdir "runs/mqar_priors/learn_prior=True,prior_family=row,seed=0"

Each point is the README's default job with another prior; `palimpsa-analyze` on a point shows
its learned prior (analysis.json: `learned_prior`, per layer).
"""
from palimpsa_jax.experiments.mqar import common

FAMILIES = (("head", False), ("head", True), ("row", True), ("synapse", True))
SEEDS = (0, 1, 2)


def get_sweep(arg=None):
    if arg not in (None, ""):
        raise ValueError(f"config argument must be empty, got {arg!r}")
    points = []
    for family, learn in FAMILIES:
        for seed in SEEDS:
            c = common.cpu("palimpsa_d")
            c.seed = seed
            c.model.update(prior_family=family, learn_prior=learn)
            points.append(c)
    return points


def get_config(arg=None):
    return get_sweep(arg)[0]
