"""Does an MQAR replica program give the same parameters every time on this device?

Trains one point of the paper's recipe (`experiments/mqar/common.py`, one replica) for --steps
steps twice with the same compiled program and prints the largest parameter difference between
the two (run-to-run determinism of the device); with --save it keeps the parameters, and with
--compare it prints their difference to those another process saved (a second compilation, whose
autotuning may choose other kernels). It also prints the second run's milliseconds per step (the
loop of `training.replicas`, compiled), so that the cost of a flag such as
XLA_FLAGS=--xla_gpu_deterministic_ops=true is read from two processes, one with and one without.

    python -m benchmarks.mqar_determinism --mixer palimpsa_d --steps 200 --save /tmp/a.npz
    python -m benchmarks.mqar_determinism --mixer palimpsa_d --steps 200 --compare /tmp/a.npz
"""
from __future__ import annotations

import argparse
import pathlib
import time

import jax
import numpy as np

from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.training import replicas


def trained_params(group: replicas.ReplicaGroup, steps: int
                   ) -> tuple[dict[str, np.ndarray], float]:
    """The replica's parameters after `steps` steps from its initialisation, by path, and the
    seconds the steps took (the first call of a process includes the compilation)."""
    state = jax.block_until_ready(group.init_state())
    start = time.perf_counter()
    for step in range(steps):
        state, _ = group.train_step(state, group.pass_orders(step))
    params = jax.block_until_ready(state["params"])
    seconds = time.perf_counter() - start
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}, seconds


def largest_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    if a.keys() != b.keys():
        raise ValueError("the two parameter sets have different paths")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixer", default="palimpsa_d", choices=common.MIXERS)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=common.PAPER_LRS[2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-train", type=int, default=8192)
    parser.add_argument("--save", type=pathlib.Path)
    parser.add_argument("--compare", type=pathlib.Path)
    args = parser.parse_args(argv)
    point = common.paper(args.mixer, args.seq_len, args.pairs, args.batch, args.lr, seed=1)
    point.data.num_train, point.data.num_test = args.num_train, 8
    group = replicas.ReplicaGroup([point])
    (first, _), (second, seconds) = (trained_params(group, args.steps) for _ in range(2))
    device = jax.devices()[0]
    print(f"{args.mixer}, {args.seq_len} / {args.pairs}, batch {args.batch}, lr {args.lr:.3g}, "
          f"{args.steps} steps on {device.device_kind}, jax {jax.__version__}")
    print(f"same program twice: largest parameter difference {largest_difference(first, second):.3g}")
    print(f"second run, compiled: ms per step {1e3 * seconds / args.steps:.3f}")
    if args.compare:
        with np.load(args.compare) as saved:
            other = dict(saved)
        print(f"against {args.compare} (another compilation): largest parameter difference "
              f"{largest_difference(first, other):.3g}")
    if args.save:
        np.savez(args.save, **first)


if __name__ == "__main__":
    main()
