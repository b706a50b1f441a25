r"""palimpsa-sweep: every grid point of an experiment file.

    palimpsa-sweep --config experiments/mqar/sweep.py[:paper] --workdir runs/mqar_sweep \
        [--config.train.steps=2000 ...]
    palimpsa-sweep --summarize --workdir runs/mqar_sweep

`--config path.py[:arg]` names a file with `get_sweep(arg)` (the points) and `get_config(arg)`
(against which `--config.<key>=<value>` overrides are parsed; they apply to every point, an
unknown key is an error). Each point runs in --workdir/<point name>; run the same command again
to continue an interrupted sweep. `--summarize` only rebuilds results.csv, results.md and
accuracy.png from the finished points. Also `python -m palimpsa_jax.commands.sweep`.
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from palimpsa_jax.commands import common
from palimpsa_jax.training import grid


def _define_flags():
    config_flags.DEFINE_config_file("config", None, "Sweep file, path.py[:arg], with "
                                    "get_sweep(arg) and get_config(arg).")
    flags.DEFINE_string("workdir", None, "Directory of the sweep (a run per point, results).")
    flags.DEFINE_bool("summarize", False, "Only rebuild the results of --workdir.")
    flags.mark_flag_as_required("workdir")


def _main():
    f = flags.FLAGS
    if f.summarize:
        rows = grid.summarize(f.workdir)
    elif f.config is None:
        raise app.UsageError("--config is required (or --summarize)")
    else:
        config_flag = f["config"]
        points = grid.load_grid(config_flags.get_config_filename(config_flag))
        points = grid.apply_overrides(points, config_flags.get_override_values(config_flag))
        rows = grid.run_grid(points, f.workdir)
    print(f"{len(rows)} finished points: {f.workdir}/results.md, results.csv, accuracy.png")


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
