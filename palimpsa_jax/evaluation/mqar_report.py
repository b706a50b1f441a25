"""MQAR results of a grid: the best learning rate per (variant, slice), its accuracy over seeds
(mean, min-max), and the paper's figure (accuracy against sequence length per mixer).

A row is one finished grid point (as `palimpsa_jax.training.grid.summarize` collects them): its
varying config columns (`mixer`, `optim.lr`, `seed`, ...) and `eval/<slice>/accuracy` for the
MQAR slices `seq<T>_pairs<P>` it was evaluated on. Rows that differ only in `seed` are one
setting; rows that differ only in the learning rate and seed are one variant, whose best
learning rate is the one with the highest mean accuracy over the seeds that every one of its
learning rates has run (all seeds of a complete grid; a rate run on more seeds is not compared
on its extra ones, nor favoured or penalised by them), reported with its mean and min-max over
all its seeds.
"""
from __future__ import annotations

import pathlib
import re
import statistics
from typing import Any

SLICE = re.compile(r"seq(\d+)_pairs(\d+)")
LR, SEED, MIXER = "optim.lr", "seed", "mixer"
# Columns that follow from the MQAR setting (the slice) rather than define a variant.
SETTING = ("data.seq_len", "data.num_pairs", "data.eval_slices", "batch_size", "train.steps",
           "checkpoint.every_steps", "eval.every_steps", "optim.schedule_every_steps",
           "log.diagnostics_every_steps")


def slice_order(name: str) -> tuple:
    match = SLICE.fullmatch(name)
    return (0, int(match[1]), int(match[2]), "") if match else (1, 0, 0, name)


def cell(value, digits: int = 4) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header: list[str], lines: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(cells) + " |"
                     for cells in [header, ["---"] * len(header), *lines]) + "\n"


def variant(row: dict[str, Any]) -> str:
    """The row's variant: its mixer and every other varying column that is not the learning
    rate, the seed or a consequence of the setting (e.g. `palimpsa_d, prior_family=row`)."""
    extra = [f"{key.rsplit('.', 1)[-1]}={row[key]}" for key in row
             if key not in (MIXER, LR, SEED, "name", *SETTING) and "/" not in key
             and key != "step"]
    return ", ".join([str(row.get(MIXER))] + extra)


def best_learning_rates(rows: list[dict], slices: list[str]) -> list[dict[str, Any]]:
    """Per (variant, slice) with results: the learning rate of highest mean accuracy over the
    seeds every rate has run (over all seeds where no seed is common to the rates), with its
    mean, min and max over all its seeds and the number of seeds."""
    best = []
    for name in dict.fromkeys(variant(row) for row in rows):
        for s in slices:
            key = f"eval/{s}/accuracy"
            by_lr: dict[float, dict[Any, float]] = {}
            for row in rows:
                if variant(row) == name and row.get(key) is not None:
                    by_lr.setdefault(row[LR], {})[row.get(SEED)] = row[key]
            if by_lr:
                common = set.intersection(*(set(seeds) for seeds in by_lr.values()))
                lr = max(by_lr, key=lambda rate: statistics.mean(
                    a for seed, a in by_lr[rate].items() if seed in common or not common))
                accuracies = list(by_lr[lr].values())
                best.append({"variant": name, "slice": s, LR: lr,
                             "mean": statistics.mean(accuracies), "min": min(accuracies),
                             "max": max(accuracies), "seeds": len(accuracies)})
    return best


def report(rows: list[dict], slices: list[str], plot_path: pathlib.Path) -> str:
    """The Markdown section of the best learning rates (empty without MQAR slices); writes the
    figure to plot_path when there is one."""
    mqar = [s for s in slices if SLICE.fullmatch(s)]
    best = best_learning_rates(rows, mqar)
    if not best:
        return ""
    _plot(best, plot_path)
    lines = [[b["variant"], b["slice"], f"{b[LR]:.4g}", f"{b['mean']:.4f}",
              f"{b['min']:.4f}-{b['max']:.4f}", str(b["seeds"])] for b in best]
    return ("\n## Best learning rate per (variant, slice), accuracy over seeds\n\n"
            + table(["variant", "slice", "lr", "mean accuracy", "min-max", "seeds"], lines)
            + f"\n![accuracy against sequence length]({plot_path.name})\n")


def _plot(best: list[dict], path: pathlib.Path) -> None:
    """Mean accuracy (best learning rate; bars: min-max over seeds) against sequence length."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state; saved with Agg

    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.subplots()
    lengths = set()
    for name in dict.fromkeys(b["variant"] for b in best):
        points = sorted((slice_order(b["slice"])[1], b) for b in best if b["variant"] == name)
        xs = [x for x, _ in points]
        means = [b["mean"] for _, b in points]
        spread = [[b["mean"] - b["min"] for _, b in points], [b["max"] - b["mean"] for _, b in points]]
        lengths.update(xs)
        ax.errorbar(xs, means, yerr=spread, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)])
    ax.set_xticks([], minor=True)
    ax.legend(fontsize="small")
    ax.set(xlabel="sequence length (evaluation slice)",
           ylabel="test accuracy (best learning rate)", ylim=(0, 1.02),
           title="MQAR: mean over seeds, bars min-max")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
