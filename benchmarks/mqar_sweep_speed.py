"""Speed of the MQAR sweep runner against the bare train step, per mixer.

For each mixer at an MQAR setting of the paper (default 512 tokens, 128 pairs, batch 128, the
authors' recipe in experiments/mqar/common.py) it times, as the median of repeated steps after
compilation:
- bare: the trainer's compiled train step (`Trainer.train_step`) on a batch already on the
  device;
- bare 4B: the same step at four times the batch, the work of four replicas in one model
  (its ratio to bare is what stacking four replicas can at best cost, whatever the runner does);
- replicas x1, x4: one step of the vmapped replica program (`training.replicas.ReplicaGroup`)
  with 1 and 4 replicas (4 learning rates), data gathered on the device inside the step.
Targets (issue 12): x1 <= 1.1 bare; x4 <= 2.5 x1. Prints a Markdown table, with x4 against
bare 4B (what stacking costs beyond the arithmetic). --programs times some of the four only (each
compiles once; a ratio is printed where both its programs ran). With --trace-dir,
also the device time of 3 profiled steps of bare and x1 (JAX profiler) and the operations whose
time differs most between them (where a replica's step spends its extra time).

    python -m benchmarks.mqar_sweep_speed --mixers palimpsa_d gated_deltanet --steps 20
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python -m benchmarks.mqar_sweep_speed --programs bare x1
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import platform
import re

import jax
import numpy as np

from benchmarks.mqar_step_profile import device_events, median_ms
from palimpsa_jax import sharding
from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.training import Trainer, replicas

PROGRAMS = ("bare", "bare4B", "x1", "x4")


def median_seconds(step, repeats: int, trace_dir: pathlib.Path | None = None) -> float:
    """Median seconds of `step` after a first run; then 3 steps profiled into trace_dir."""
    seconds = median_ms(step, repeats) / 1e3
    if trace_dir is not None:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(3):
                jax.block_until_ready(step())
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", default=list(common.MIXERS), choices=common.MIXERS)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--num-train", type=int, default=4096,
                        help="examples materialised (the speed does not depend on it)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS,
                        help="the programs timed (default all)")
    parser.add_argument("--trace-dir", type=pathlib.Path,
                        help="profile 3 steps of bare and x1 here and compare their device time")
    args = parser.parse_args(argv)
    if args.trace_dir and not {"bare", "x1"} <= set(args.programs):
        parser.error("--trace-dir compares bare with x1: --programs must include both")

    device = jax.devices()[0]
    print(f"device {device.device_kind} ({device.platform}), jax {jax.__version__}, python "
          f"{platform.python_version()}; MQAR {args.seq_len} tokens / {args.pairs} pairs, batch "
          f"{args.batch}, bf16 compute; median of {args.steps} steps\n")
    print("| mixer | bare step ms | bare 4B ms | 4B / bare | replicas x1 ms | x1 / bare | "
          "replicas x4 ms | x4 / x1 | x4 / bare 4B |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mixer in args.mixers:
        s = time_mixer(mixer, args)

        def ms(name, s=s):
            return f"{1e3 * s[name]:.2f}" if name in s else "-"

        def ratio(a, b, s=s):
            return f"{s[a] / s[b]:.2f}" if a in s and b in s else "-"
        print(f"| {mixer} | {ms('bare')} | {ms('bare4B')} | {ratio('bare4B', 'bare')} | "
              f"{ms('x1')} | {ratio('x1', 'bare')} | {ms('x4')} | {ratio('x4', 'x1')} | "
              f"{ratio('x4', 'bare4B')} |", flush=True)
    if args.trace_dir:
        for mixer in args.mixers:
            compare_traces(args.trace_dir / mixer)


def compare_traces(trace_dir: pathlib.Path, count: int = 15) -> None:
    """Device ms and events per step of the profiled bare and x1 steps (3 each), and the kinds
    of operation (event names without their numeric suffix) whose time differs most."""
    kinds = {}
    for name in ("bare", "x1"):
        events = device_events(trace_dir / name)
        kinds[name] = collections.Counter()
        for event, ms in events:
            kinds[name][re.sub(r"[._\d]+$", "", event)] += ms / 3
        print(f"\n{trace_dir.name} {name}: {sum(ms for _, ms in events) / 3:.3f} device ms and "
              f"{len(events) / 3:.0f} device events per step")
    bare, one = kinds["bare"], kinds["x1"]
    print("largest differences (x1 - bare, device ms per step):")
    for kind in sorted(set(bare) | set(one), key=lambda k: -abs(one[k] - bare[k]))[:count]:
        print(f"  {one[kind] - bare[kind]:+8.3f}  bare {bare[kind]:7.3f}  x1 {one[kind]:7.3f}  "
              f"{kind[:90]}")


def time_mixer(mixer: str, args) -> dict[str, float]:
    """Median seconds of each of args.programs: the bare step at the batch (bare) and at 4x it
    (bare4B), and the replica step with 1 and 4 replicas (x1, x4)."""
    points = [common.paper(mixer, args.seq_len, args.pairs, args.batch, lr, seed=1)
              for lr in common.PAPER_LRS]
    for p in points:
        p.data.num_train = args.num_train
        p.data.num_test = 8
        p.log.progress = False
    trace = (lambda name: args.trace_dir / mixer / name) if args.trace_dir else lambda _: None
    tokens, labels = replicas.ReplicaGroup(points[:1]).train_data
    programs = {
        "bare": lambda: bare_seconds(points[0], tokens, labels, args.batch, args.steps,
                                     trace("bare")),
        "bare4B": lambda: bare_seconds(points[0], tokens, labels, 4 * args.batch, args.steps,
                                       None),
        "x1": lambda: replica_seconds(points[:1], args.steps, trace("x1")),
        "x4": lambda: replica_seconds(points, args.steps),
    }
    return {name: programs[name]() for name in PROGRAMS if name in args.programs}


def bare_seconds(config, tokens, labels, batch_size: int, repeats: int,
                 trace_dir: pathlib.Path | None) -> float:
    """Median seconds of the trainer's step at batch_size on a batch already on the device."""
    if batch_size > len(tokens):
        raise ValueError(f"--num-train ({len(tokens)}) must be at least 4 x --batch "
                         f"({batch_size})")
    config = config.copy_and_resolve_references()
    config.batch_size = batch_size
    trainer = Trainer(config)
    with sharding.use_mesh(trainer.mesh, trainer.rules):
        batch = trainer.global_batch({"tokens": np.asarray(tokens[:batch_size]),
                                      "labels": np.asarray(labels[:batch_size])})
        holder = {"state": trainer.init_state()}

        def step():
            holder["state"], out = trainer.train_step(holder["state"], batch)
            return out
        return median_seconds(step, repeats, trace_dir)


def replica_seconds(points, repeats: int, trace_dir: pathlib.Path | None = None) -> float:
    """Median seconds of one step of the points trained as replicas."""
    group = replicas.ReplicaGroup(points)
    holder = {"state": group.init_state(), "step": 0}

    def step():    # as `train_group`: the pass orders are drawn when a pass begins
        orders = group.pass_orders(holder["step"])
        holder["state"], out = group.train_step(holder["state"], orders)
        holder["step"] += 1
        return out
    return median_seconds(step, repeats, trace_dir)

if __name__ == "__main__":
    main()
