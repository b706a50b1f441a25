r"""Command line of a sweep: every grid point of an experiment file, one after another.

    python -m palimpsa_jax.sweep --config experiments/mqar/sweep.py[:paper] --workdir runs/mqar_sweep \
        [--config.train.steps=2000 ...]
    python -m palimpsa_jax.sweep --summarize --workdir runs/mqar_sweep

`--config path.py[:arg]` names a file with `get_sweep(arg)` (the points) and `get_config(arg)`
(against which `--config.<key>=<value>` overrides are parsed; they apply to every point, an
unknown key is an error). Each point runs in --workdir/<point name>; run the same command again
to continue an interrupted sweep. `--summarize` only rebuilds results.csv, results.md and
accuracy.png from the finished points. Installed as the console script `palimpsa-sweep`.
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from palimpsa_jax.training import cli, sweep

_CONFIG = config_flags.DEFINE_config_file("config", None, "Sweep file, path.py[:arg], with "
                                          "get_sweep(arg) and get_config(arg).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the sweep (a run per point, "
                               "results).")
_SUMMARIZE = flags.DEFINE_bool("summarize", False, "Only rebuild the results of --workdir.")
flags.mark_flag_as_required("workdir")


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.quiet_logging()
    if _SUMMARIZE.value:
        rows = sweep.summarize(_WORKDIR.value)
    elif _CONFIG.value is None:
        raise app.UsageError("--config is required (or --summarize)")
    else:
        config_flag = flags.FLAGS["config"]
        points = sweep.load_sweep(config_flags.get_config_filename(config_flag))
        points = sweep.apply_overrides(points, config_flags.get_override_values(config_flag))
        rows = sweep.run_sweep(points, _WORKDIR.value)
    print(f"{len(rows)} finished points: {_WORKDIR.value}/results.md, results.csv, accuracy.png")


def main():
    app.run(_main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
    main()
