"""Metaplastic surgery in small (issue 16; benchmarks/RESULTS.md): a pretrained Mamba2, its
weakest-forgetting layers converted to Palimpsa-M and fine-tuned, against the same fine-tuning
without surgery, over seeds. Every stage is one of the project's commands, run as a subprocess:

    palimpsa-train (the base) -> palimpsa-surgery --layers L / none (per seed) ->
    palimpsa-train --resume (both arms, --parallel at once) -> palimpsa-long-context

and the script prints (and writes to --output) the validation loss of each arm and seed, the
paired differences, the loss by position and the passkey accuracy. The corpus is a directory
made by palimpsa-prepare (train-*.npy, validation-*.npy, tokenizer.json, eos id 0).

    python -m benchmarks.surgery_in_small --corpus /tmp/corpus --root /tmp/surgery \
        --seeds 0 1 2 --parallel 4 --output surgery.md
    python -m benchmarks.surgery_in_small --corpus corpus --root /tmp/s --small   # CPU smoke run

A stage whose run already holds its result is not run again, so a run cut by a time limit
continues where it stopped (fine-tuning resumes from its last checkpoint).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

import palimpsa_jax.experiments
from benchmarks.command_runs import (
    SMALL,
    SMALL_STEPS,
    add_arguments,
    command,
    in_batches,
    metrics,
    resume,
    wait,
    workspace,
)

EXPERIMENTS = pathlib.Path(palimpsa_jax.experiments.__file__).parent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--layers", default="weakest:4", help="palimpsa-surgery --layers of the surgery arm")
    parser.add_argument("--pretrain", default=f"{EXPERIMENTS}/lm/zoo.py:mamba2", help="experiment file of the base")
    parser.add_argument("--finetune", default=f"{EXPERIMENTS}/surgery/mamba2.py:zoo",
                        help="fine-tuning experiment file of both arms")
    add_arguments(parser)
    args = parser.parse_args(argv)

    corpus, root, logs, env = workspace(args)
    data = (f"--config.data.path={corpus}/train-*.npy", f"--config.data.test_path={corpus}/validation-*.npy")
    small = SMALL if args.small else ()
    steps = SMALL_STEPS if args.small else ()

    base = root / "pretrained"
    if not metrics(base):
        wait({"pretrain": command(
            "train", "--config", args.pretrain, "--workdir", str(base), *data, "--config.log.progress=False",
            f"--config.data.tokenizer={corpus}/tokenizer.json", "--config.data.eos_id=0", *small, *steps,
            *resume(base))}, logs)

    arms = {"surgery": args.layers, "control": "none"}
    runs = {(arm, seed): root / f"{arm}_s{seed}" for arm in arms for seed in args.seeds}
    surgery_args = tuple(a for a in small if "n_layers" not in a and "d_model" not in a)
    in_batches({f"surgery_{arm}_s{seed}": (
        "surgery", "--from", str(base), "--workdir", str(run), "--layers", arms[arm], "--probe",
        f"{corpus}/validation-*.npy", "--config", args.finetune, *data, f"--config.seed={seed}",
        "--config.checkpoint.every_steps=100", *surgery_args, *steps, *(("--probe_rows=2",) if args.small else ()))
        for (arm, seed), run in runs.items() if not (run / "config.json").exists()}, args.parallel, logs, env)
    in_batches({f"finetune_{run.name}": (
        "train", "--config", str(run / "experiment.py"), "--workdir", str(run), "--resume",
        "--config.log.progress=False") for run in runs.values() if not metrics(run)}, args.parallel, logs, env)
    passkey = ("--passkey_lengths=128", "--trials=1") if args.small else ()
    length = 256 if args.small else args.length
    in_batches({f"long_context_{run.name}": (
        "long_context", "--workdir", str(run), f"--length={length}", "--documents=64",
        f"--min_length={length}", "--batch_size=8", *passkey)
        for run in [base, *runs.values()] if not (run / "long_context" / "passkey_prose.json").exists()},
        args.parallel, logs, env)

    report = _report(base, runs, args.seeds, args.layers)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")


def _report(base: pathlib.Path, runs: dict, seeds: list[int], layers: str) -> str:
    record = json.loads((runs["surgery", seeds[0]] / "surgery.json").read_text())
    lines = [f"base {base}: validation loss {metrics(base)['eval/loss']:.4f}; surgery {layers} converts "
             f"layers {record['layers']} (windows {[round(w, 1) for w in record['windows']]})", "",
             "| seed | surgery | control | difference |", "|---|---|---|---|"]
    differences = []
    for seed in seeds:
        meta, control = (metrics(runs[arm, seed])["eval/loss"] for arm in ("surgery", "control"))
        differences.append(meta - control)
        lines.append(f"| {seed} | {meta:.4f} | {control:.4f} | {meta - control:+.4f} |")
    lines.append(f"| mean | | | {np.mean(differences):+.4f} (std {np.std(differences):.4f}) |")
    lines += ["", "| positions | " + " | ".join(f"{arm} s{seed}" for arm, seed in runs) + " | base |",
              "|---" * (len(runs) + 2) + "|"]
    tables = {name: json.loads((run / "long_context" / "loss_by_position.json").read_text())["buckets"]
              for name, run in [*runs.items(), ("base", base)]}
    for i, bucket in enumerate(tables["base"]):
        lines.append(f"| {bucket['first']}-{bucket['last']} | "
                     + " | ".join(f"{tables[name][i]['mean_loss']:.4f}" for name in tables) + " |")
    best = {name: max(map(max, json.loads((run / "long_context" / "passkey_prose.json").read_text())["accuracy"]))
            for name, run in [*runs.items(), ("base", base)]}
    lines += ["", "passkey, best cell: " + ", ".join(
        f"{name if isinstance(name, str) else f'{name[0]} s{name[1]}'} {value:.2f}" for name, value in best.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
