"""Test accuracy against training step for every point of MQAR sweep workdirs (their
metrics.jsonl), one panel per learning rate, a line per workdir and seed; with --figure also
the paper's figure over all the workdirs (final test accuracy against sequence length, each mixer at its
best learning rate, bars min-max over seeds) and its table, printed as Markdown. `--results`
adds finished points from `results.csv` files (a sweep's, or `benchmarks/mqar_points.csv`, the
record of every point run on the GPU) to the figure: it can be drawn without the run folders.
Where the rows carry an `epochs` column (the length of their cosine schedule) and more than one
value occurs in it, `--epochs N` picks the points of one schedule: one figure never mixes two.

    python -m benchmarks.mqar_curves runs/m512/* --out benchmarks/mqar_512_curves.png
    python -m benchmarks.mqar_curves runs/m512/* runs/m1024/* --out curves.png --figure fig.png
    python -m benchmarks.mqar_curves --results benchmarks/mqar_points.csv --epochs 8 --figure fig.png
"""
import argparse
import csv
import json
import pathlib

import matplotlib
import ml_collections

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from palimpsa_jax.evaluation import mqar_report
from palimpsa_jax.training import grid


def is_slice_accuracy(key: str) -> bool:
    """Whether a metric is the test accuracy of one MQAR slice: eval/seq<L>_pairs<P>/accuracy."""
    parts = key.split("/")
    return (len(parts) == 3 and parts[0] == "eval" and parts[2] == "accuracy"
            and mqar_report.SLICE.fullmatch(parts[1]) is not None)


def curves(workdirs):
    """{lr: {(workdir name, seed): [(step, accuracy), ...]}} from every
    <workdir>/<point>/metrics.jsonl (a workdir is one mixer's, as in the commands above)."""
    found = {}
    for workdir in map(pathlib.Path, workdirs):
        for metrics in sorted(workdir.glob("*/metrics.jsonl")):
            config = json.loads((metrics.parent / "config.json").read_text())
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
            points = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
            found.setdefault(config["optim"]["lr"], {})[workdir.name, config["seed"]] = points
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
                        if is_slice_accuracy(k)}
            rows.append({mqar_report.MIXER: grid.mixer_label(config),
                         mqar_report.LR: config.optim.lr, mqar_report.SEED: config.seed,
                         **accuracy})
    return rows


def csv_rows(paths, epochs: int | None = None) -> list[dict]:
    """The rows of `results.csv` files as `final_rows` gives them: mixer, learning rate, seed
    and the accuracy per MQAR slice (other columns, e.g. a run's session, are left out). Rows
    with an `epochs` column: those of `epochs` alone; without it, a ValueError where the rows
    hold several schedules."""
    rows, schedules = [], set()
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                schedule = int(row["epochs"]) if row.get("epochs") else None
                schedules.add(schedule)
                if epochs is not None and schedule != epochs:
                    continue
                accuracy = {k: float(v) for k, v in row.items()
                            if is_slice_accuracy(k) and v}
                rows.append({mqar_report.MIXER: row[mqar_report.MIXER],
                             mqar_report.LR: float(row[mqar_report.LR]),
                             mqar_report.SEED: int(row[mqar_report.SEED]), **accuracy})
    seen = sorted(schedules, key=lambda e: e or 0)      # None: rows without the column
    if epochs is None and len(seen) > 1:
        raise ValueError(f"the results hold points of several schedules (epochs {seen}): "
                         "choose one with --epochs")
    if epochs is not None and epochs not in schedules:
        raise ValueError(f"--epochs {epochs}: no row of the results has epochs={epochs} "
                         f"(they have {seen})")
    return rows


def figure(workdirs, path: pathlib.Path, results=(), epochs: int | None = None) -> str:
    """Writes the paper's figure over the workdirs' points and the rows of the `results` CSV
    files (of the schedule of `epochs`, see `csv_rows`) to `path`; returns its table
    (Markdown)."""
    rows = final_rows(workdirs) + csv_rows(results, epochs)
    slices = sorted({k.split("/")[1] for row in rows for k in row if k.startswith("eval/")},
                    key=mqar_report.slice_order)
    return mqar_report.report(rows, slices, pathlib.Path(path))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="*")
    parser.add_argument("--out", help="the curves of the workdirs' points (PNG)")
    parser.add_argument("--figure", help="also write the paper's figure here (PNG)")
    parser.add_argument("--results", nargs="+", default=[],
                        help="results.csv files whose points join the figure")
    parser.add_argument("--epochs", type=int,
                        help="the results' rows of this schedule alone (their `epochs` column)")
    args = parser.parse_args(argv)
    if bool(args.workdirs) != bool(args.out):
        parser.error("--out and workdirs go together (the curves are drawn from the workdirs)")
    if not (args.out or args.figure):
        parser.error("nothing to draw: give workdirs with --out, or --figure")
    if args.results and not args.figure:
        parser.error("--results joins the figure: give --figure")
    if args.epochs is not None and not args.results:
        parser.error("--epochs picks rows of --results: give --results")
    if args.out:
        draw_curves(args.workdirs, args.out)
    if args.figure:
        try:
            print(figure(args.workdirs, args.figure, args.results, args.epochs))
        except ValueError as e:
            parser.error(str(e))


def draw_curves(workdirs, out: str) -> None:
    """Test accuracy against step, a panel per learning rate, a line per workdir and seed
    (colour: workdir, line style: seed)."""
    found = curves(workdirs)
    mixers = sorted({mixer for by_run in found.values() for mixer, _ in by_run})
    seeds = sorted({seed for by_run in found.values() for _, seed in by_run})
    colour = {mixer: f"C{i}" for i, mixer in enumerate(mixers)}     # the same in every panel
    style = dict(zip(seeds, ["-", "--", ":", "-."] * len(seeds)))   # one per seed
    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 3.6), squeeze=False)
    for ax, (lr, by_run) in zip(axes[0], sorted(found.items())):
        for (mixer, seed), points in sorted(by_run.items()):
            label = mixer if len(seeds) == 1 else f"{mixer} seed {seed}"
            ax.plot(*zip(*points), marker=".", label=label, color=colour[mixer],
                    linestyle=style[seed])
        ax.set(title=f"lr {lr:.3g}", xlabel="training step", ylabel="test accuracy", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
