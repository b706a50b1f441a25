"""The README's default job (the CPU job of `common.py`, Palimpsa-D) over seeds 0-7 and three
learning rates, with test accuracy every 50 steps: how often, and when, each setting leaves the
task's plateau at accuracy 1/4 within its 1,000 steps (measured: `common.cpu`'s docstring).

    palimpsa-sweep --config experiments/mqar/cpu_seeds.py --workdir runs/mqar_cpu_seeds

The 24 points share a model, so they train as one vmapped program (`training.replicas`, data
order from each replica's seed; the launcher's own data order differs, so a point here is not
bit-identical to `palimpsa-train` with that seed). Made for a GPU (2.5 minutes on one H200 with four
other grids beside it); on two CPU cores the program costs about 24 default jobs.
"""
from palimpsa_jax.experiments.mqar import common

SEEDS = tuple(range(8))
LRS = (3e-3, 6e-3, 1e-2)


def get_sweep(arg=None):
    if arg not in (None, ""):
        raise ValueError(f"config argument must be empty, got {arg!r}")
    points = []
    for lr in LRS:
        for seed in SEEDS:
            c = common.cpu("palimpsa_d")
            c.seed, c.optim.lr = seed, lr
            c.eval.every_steps = 50
            points.append(c)
    return points


def get_config(arg=None):
    return get_sweep(arg)[0]
