"""Test accuracy against training step for every point of MQAR sweep workdirs (their
metrics.jsonl), one panel per learning rate, a line per mixer.

    python -m benchmarks.mqar_curves runs/m512/* --out benchmarks/mqar_512_curves.png
"""
import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    found = curves(args.workdirs)
    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 3.6), squeeze=False)
    for ax, (lr, by_mixer) in zip(axes[0], sorted(found.items())):
        for mixer, points in sorted(by_mixer.items()):
            ax.plot(*zip(*points), marker=".", label=mixer)
        ax.set(title=f"lr {lr:.3g}", xlabel="training step", ylabel="test accuracy", ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
