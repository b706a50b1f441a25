"""Speed of the MQAR sweep runner against the bare train step, per mixer.

For each mixer at an MQAR setting of the paper (default 512 tokens, 128 pairs, batch 128, the
authors' recipe in experiments/mqar/common.py) it times, as the median of repeated steps after
compilation:
- bare: the trainer's compiled train step (`Trainer.train_step`) on a batch already on the
  device;
- replicas x1, x4: one step of the vmapped replica program (`training.replicas.ReplicaGroup`)
  with 1 and 4 replicas (4 learning rates), data gathered on the device inside the step.
Targets (issue 12): x1 <= 1.1 bare; x4 <= 2.5 x1. Prints a Markdown table.

    python -m benchmarks.mqar_sweep_speed --mixers palimpsa_d gated_deltanet --steps 20
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import numpy as np

from palimpsa_jax import sharding
from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.training import Trainer, replicas


def median_seconds(step, repeats: int) -> float:
    jax.block_until_ready(step())            # compilation and a first run
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", default=list(common.MIXERS), choices=common.MIXERS)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--num-train", type=int, default=4096,
                        help="examples materialised (the speed does not depend on it)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    print(f"device {device.device_kind} ({device.platform}), jax {jax.__version__}, python "
          f"{platform.python_version()}; MQAR {args.seq_len} tokens / {args.pairs} pairs, batch "
          f"{args.batch}, bf16 compute; median of {args.steps} steps\n")
    print("| mixer | bare step ms | replicas x1 ms | x1 / bare | replicas x4 ms | x4 / x1 |")
    print("|---|---|---|---|---|---|")
    for mixer in args.mixers:
        bare, one, four = time_mixer(mixer, args)
        print(f"| {mixer} | {1e3 * bare:.2f} | {1e3 * one:.2f} | {one / bare:.2f} | "
              f"{1e3 * four:.2f} | {four / one:.2f} |", flush=True)


def time_mixer(mixer: str, args) -> tuple[float, float, float]:
    """Median seconds of the bare step and of the replica step with 1 and 4 replicas."""
    points = [common.paper(mixer, args.seq_len, args.pairs, args.batch, lr, seed=1)
              for lr in common.PAPER_LRS]
    for p in points:
        p.data.num_train = args.num_train
        p.data.num_test = 8
        p.log.progress = False
    trainer = Trainer(points[0])
    with sharding.use_mesh(trainer.mesh, trainer.rules):
        tokens, labels = replicas.ReplicaGroup(points[:1]).train_data
        batch = trainer.global_batch({"tokens": np.asarray(tokens[:args.batch]),
                                      "labels": np.asarray(labels[:args.batch])})
        holder = {"state": trainer.init_state()}

        def bare():
            holder["state"], out = trainer.train_step(holder["state"], batch)
            return out
        bare_s = median_seconds(bare, args.steps)
    return bare_s, *(replica_seconds(points[:count], args.steps) for count in (1, 4))


def replica_seconds(points, repeats: int) -> float:
    """Median seconds of one step of the points trained as replicas."""
    group = replicas.ReplicaGroup(points)
    holder = {"state": group.init_state()}

    def step():
        holder["state"], out = group.train_step(holder["state"])
        return out
    return median_seconds(step, repeats)

if __name__ == "__main__":
    main()
