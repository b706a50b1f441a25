"""MQAR at the paper's setting (sequence 512, 128 pairs, vocabulary 8192; SPEC section 5) for
several mixers with the same budget of optimiser steps, through the project's own trainer.
Prints (and writes with --output) a Markdown table: final test accuracy, train loss, tokens/s.

    python benchmarks/mqar_compare.py --steps 2000 --workdir /tmp/mqar --output mqar.md
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import traceback

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _ROOT / "benchmarks"]
sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
from absl import logging  # noqa: E402

from palimpsa_jax.training import mqar_config, train_and_evaluate  # noqa: E402

# label -> (mqar_config mixer, model changes)
MIXERS = {
    "palimpsa_d": ("palimpsa_d", {}),
    "gated_deltanet": ("gated_deltanet", {}),
    "mamba2": ("mamba2", {}),
    "palimpsa_d_off": ("palimpsa_d", {"metaplasticity": False}),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    parser.add_argument("--output", type=pathlib.Path)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)

    rows = []
    for label in args.mixers:
        mixer, changes = MIXERS[label]
        config = mqar_config(mixer, "paper", **changes)
        config.train.steps = args.steps
        config.optim.lr = args.lr
        config.checkpoint.every_steps = args.steps
        config.eval.every_steps = 0
        config.log.update(progress=False, every_steps=100, diagnostics_every_steps=0)
        start = time.perf_counter()
        try:
            final = train_and_evaluate(config, args.workdir / label)
        except Exception:  # noqa: BLE001 - report the failure, go on with the other mixers
            traceback.print_exc()
            rows.append(f"| {label} | failed (see log) | | | | |")
            continue
        wall = time.perf_counter() - start
        print(label, json.dumps(final), flush=True)
        rows.append(f"| {label} | {final['eval/accuracy']:.4f} | {final['train/loss']:.4f} | "
                    f"{final['train/tokens_per_s']:.3g} | {args.steps} | {wall:.0f} |")

    header = [
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; MQAR paper setting "
        f"(seq 512, 128 pairs, vocab 8192, batch 128, d_model 128, 2 layers), lr {args.lr}, "
        f"{args.steps} steps each (= {args.steps * 128 / 100_000:.2f} epochs), float32",
        "",
        "| mixer | test accuracy | final train loss | train tokens/s | steps | wall s |",
        "|---|---|---|---|---|---|",
    ]
    table = "\n".join(header + rows) + "\n"
    print(table)
    if args.output:
        args.output.write_text(table)


if __name__ == "__main__":
    main()
