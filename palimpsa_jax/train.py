r"""Command line of one experiment (big_vision style):

    python -m palimpsa_jax.train --config experiments/mqar/palimpsa_d.py --workdir runs/NAME \
        [--config.optim.lr=3e-3 ...] [--resume]

`--config path.py[:arg]` loads `get_config(arg)` from the file; `--config.<key>=<value>`
overrides any key (an unknown key is an error). Installed as the console script
`palimpsa-train`.
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from palimpsa_jax.training import cli, train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, path.py[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run (checkpoints, logs).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue the run in --workdir from its last "
                            "checkpoint.")
flags.mark_flags_as_required(["config", "workdir"])


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.quiet_logging()
    final = train_and_evaluate(_CONFIG.value, _WORKDIR.value, resume=_RESUME.value)
    for name, value in sorted(final.items()):
        print(f"{name:32s} {value:.4f}" if isinstance(value, float) else f"{name:32s} {value}")


def main():
    app.run(_main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
    main()
