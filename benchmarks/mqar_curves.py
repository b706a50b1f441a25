"""Test accuracy against training step for every point of MQAR sweep workdirs (their
metrics.jsonl), one panel per learning rate, a line per mixer; with --figure also the paper's
figure over all the workdirs (final test accuracy against sequence length, each mixer at its
best learning rate, bars min-max over seeds) and its table, printed as Markdown.

    python -m benchmarks.mqar_curves runs/m512/* --out benchmarks/mqar_512_curves.png
    python -m benchmarks.mqar_curves runs/m512/* runs/m1024/* --out curves.png --figure fig.png
"""
import argparse
import json
import pathlib
import re

import matplotlib
import ml_collections

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from palimpsa_jax.evaluation import mqar_report
from palimpsa_jax.training import grid


def curves(workdirs):
    """{lr: {mixer: [(step, accuracy), ...]}} from every <workdir>/<point>/metrics.jsonl."""
    found = {}
    for workdir in map(pathlib.Path, workdirs):
        for metrics in sorted(workdir.glob("*/metrics.jsonl")):
            config = json.loads((metrics.parent / "config.json").read_text())
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
            points = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
            found.setdefault(config["optim"]["lr"], {})[workdir.name] = points
    return found


def final_rows(workdirs) -> list[dict]:
    """One row per finished point (its metrics.json) of the workdirs: mixer, learning rate,
    seed and its final test accuracy per MQAR slice, as `mqar_report` takes them."""
    rows = []
    for workdir in map(pathlib.Path, workdirs):
        for final in sorted(workdir.glob("*/metrics.json")):
            config = ml_collections.ConfigDict(
                json.loads((final.parent / "config.json").read_text()))
            accuracy = {k: v for k, v in json.loads(final.read_text()).items()
                        if re.fullmatch(r"eval/seq\d+_pairs\d+/accuracy", k)}
            rows.append({mqar_report.MIXER: grid.mixer_label(config),
                         mqar_report.LR: config.optim.lr, mqar_report.SEED: config.seed,
                         **accuracy})
    return rows


def figure(workdirs, path: pathlib.Path) -> str:
    """Writes the paper's figure to `path`; returns its table (Markdown)."""
    rows = final_rows(workdirs)
    slices = sorted({k.split("/")[1] for row in rows for k in row if k.startswith("eval/")},
                    key=mqar_report.slice_order)
    return mqar_report.report(rows, slices, pathlib.Path(path))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--figure", help="also write the paper's figure here (PNG)")
    args = parser.parse_args(argv)
    found = curves(args.workdirs)
    mixers = sorted({mixer for by_mixer in found.values() for mixer in by_mixer})
    colour = {mixer: f"C{i}" for i, mixer in enumerate(mixers)}     # the same in every panel
    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 3.6), squeeze=False)
    for ax, (lr, by_mixer) in zip(axes[0], sorted(found.items())):
        for mixer, points in sorted(by_mixer.items()):
            ax.plot(*zip(*points), marker=".", label=mixer, color=colour[mixer])
        ax.set(title=f"lr {lr:.3g}", xlabel="training step", ylabel="test accuracy", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    if args.figure:
        print(figure(args.workdirs, args.figure))


if __name__ == "__main__":
    main()
