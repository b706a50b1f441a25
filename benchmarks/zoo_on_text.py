"""The zoo on real text (issue 15; benchmarks/RESULTS.md): the models of experiments/lm/zoo.py at
equal size and token budget, trained over seeds on a corpus made by palimpsa-prepare, then the
long-context evaluation of one seed of each. Every stage is one of the project's commands, run
as a subprocess:

    palimpsa-train (per mixer and seed, --parallel at once) -> palimpsa-long-context

and the script prints (and writes to --output) the validation loss of every run with the mean
and spread over seeds per model, the loss by position and the passkey accuracy of each haystack,
and writes ROOT/loss_by_position.png (one line per model). The corpus is a directory made by
palimpsa-prepare (train-*.npy, validation-*.npy, tokenizer.json, eos id 0).

    python -m benchmarks.zoo_on_text --corpus /tmp/corpus --root /tmp/zoo --seeds 0 1 2 \
        --parallel 4 --output zoo.md
    python -m benchmarks.zoo_on_text --corpus corpus --root /tmp/z --small   # CPU smoke run

A stage whose run already holds its result is not run again, so a run cut by a time limit
continues where it stopped (training resumes from its last checkpoint).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

import palimpsa_jax.experiments
from benchmarks.command_runs import SMALL, SMALL_STEPS, add_arguments, in_batches, metrics, resume, workspace
from palimpsa_jax.evaluation import long_context as lc

ZOO = pathlib.Path(palimpsa_jax.experiments.__file__).parent / "lm" / "zoo.py"
MIXERS = ("palimpsa_d", "gated_deltanet", "mamba2", "attention")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=MIXERS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=None, help="learning rate of every run (default zoo.py's)")
    parser.add_argument("--haystacks", nargs="+", default=["prose", "python"], choices=list(lc.HAYSTACKS))
    add_arguments(parser)
    args = parser.parse_args(argv)

    corpus, root, logs, env = workspace(args)
    runs = {(mixer, seed): root / f"{mixer}_s{seed}" for mixer in args.mixers for seed in args.seeds}
    options = (f"--config.data.path={corpus}/train-*.npy", f"--config.data.test_path={corpus}/validation-*.npy",
               f"--config.data.tokenizer={corpus}/tokenizer.json", "--config.data.eos_id=0",
               "--config.log.progress=False", "--config.checkpoint.every_steps=250",
               *((f"--config.optim.lr={args.lr}",) if args.lr else ()),
               *((*SMALL, *SMALL_STEPS) if args.small else ()))
    in_batches({f"train_{run.name}": (
        "train", "--config", f"{ZOO}:{mixer}", "--workdir", str(run), f"--config.seed={seed}", *options,
        *resume(run))
        for (mixer, seed), run in runs.items() if not metrics(run)}, args.parallel, logs, env)

    evaluated = {mixer: runs[mixer, args.seeds[0]] for mixer in args.mixers}
    length = 256 if args.small else args.length
    passkey = ("--passkey_lengths=128", "--trials=1") if args.small else ()
    in_batches({f"long_context_{run.name}": (
        "long_context", "--workdir", str(run), f"--length={length}", "--documents=64", f"--min_length={length}",
        "--batch_size=8", f"--passkey_haystacks={','.join(args.haystacks)}", *passkey)
        for run in evaluated.values()
        if not all((run / "long_context" / f"passkey_{h}.json").exists() for h in args.haystacks)},
        args.parallel, logs, env)

    report = _report(runs, args.seeds, evaluated, args.haystacks)
    curves = {f"{mixer} s{args.seeds[0]}": _position_loss(run) for mixer, run in evaluated.items()}
    lc.plot_loss_by_position(curves, root / "loss_by_position.png", training_length=_training_length(runs))
    print(report)
    if args.output:
        args.output.write_text(report + "\n")


def _training_length(runs: dict) -> int:
    return json.loads((next(iter(runs.values())) / "config.json").read_text())["data"]["seq_len"]


def _position_loss(run: pathlib.Path) -> lc.PositionLoss:
    return lc.PositionLoss.from_rows(
        json.loads((run / "long_context" / "loss_by_position.json").read_text())["buckets"])


def _report(runs: dict, seeds: list[int], evaluated: dict, haystacks: list[str]) -> str:
    """Validation loss per run and per model over seeds; loss by position and passkey of the
    evaluated runs."""
    lines = ["| model | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | spread (max - min) "
             "| perplexity of the mean |", "|---" * (len(seeds) + 4) + "|"]
    for mixer in evaluated:
        losses = [metrics(runs[mixer, s])["eval/loss"] for s in seeds]
        lines.append(f"| {mixer} | " + " | ".join(f"{x:.4f}" for x in losses)
                     + f" | {np.mean(losses):.4f} | {np.ptp(losses):.4f} | {np.exp(np.mean(losses)):.2f} |")
    tables = {mixer: _position_loss(run) for mixer, run in evaluated.items()}
    lines += ["", f"loss by position (seed {seeds[0]}, nats)", "",
              "| positions | " + " | ".join(tables) + " |", "|---" * (len(tables) + 1) + "|"]
    first = next(iter(tables.values()))
    for i, (start, end) in enumerate(zip(first.first, first.last)):
        lines.append(f"| {start}-{end} | " + " | ".join(f"{t.mean_loss[i]:.4f}" for t in tables.values()) + " |")
    for haystack in haystacks:
        lines += ["", f"passkey, {haystack} haystack (seed {seeds[0]}): accuracy per depth (rows) and "
                  "length (columns)"]
        for mixer, run in evaluated.items():
            result = json.loads((run / "long_context" / f"passkey_{haystack}.json").read_text())
            cells = "; ".join(f"depth {d:g}: " + " ".join(f"{x:.2f}" for x in row)
                              for d, row in zip(result["depths"], result["accuracy"]))
            lines.append(f"- {mixer} (lengths {result['lengths']}): {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
