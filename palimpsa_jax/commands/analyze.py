r"""palimpsa-analyze: the analysis report of a trained run.

    palimpsa-analyze --workdir runs/mqar_palimpsa_d [--step 500] [--sequences 256]

Writes runs/X/analysis/report.md, analysis.json and PNGs: per layer and head the distribution of
I / prior, the KL divergence of the posterior from the prior, the fraction of consolidated
synapses, the memory windows (median and quantiles), importance along the sequence, the
predictive variance against errors and loss, and the metaplasticity ratio at every checkpoint.
Also `python -m palimpsa_jax.commands.analyze`.
"""
from __future__ import annotations

from absl import flags

from palimpsa_jax.analysis import report
from palimpsa_jax.commands import common


def _define_flags():
    flags.DEFINE_string("workdir", None, "Directory of the run.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer("sequences", 256, "Held-out sequences to analyse.")
    flags.mark_flag_as_required("workdir")


def _main():
    f = flags.FLAGS
    result = report.analyze(f.workdir, size=f.sequences, step=f.step)
    print(f"step {result['step']}: {f.workdir}/analysis/report.md")
    if "uncertainty" in result:
        u = result["uncertainty"]
        print(f"accuracy {u['accuracy']:.4f}, AUROC of variance for errors "
              f"{u['auroc_of_variance_for_errors']:.3f}")


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
