r"""palimpsa-train: one experiment (big_vision style).

    palimpsa-train --config experiments/mqar/palimpsa_d.py --workdir runs/NAME \
        [--config.optim.lr=3e-3 ...] [--resume]

`--config path.py[:arg]` loads `get_config(arg)` from the file; `--config.<key>=<value>`
overrides any key (an unknown key is an error). It prints the devices, mesh, parameter count and
tokens per step, trains with a progress bar, and prints the final metrics. A bad config value or
a missing checkpoint ends it with one line naming the key or file. Also
`python -m palimpsa_jax.commands.train`.
"""
from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from palimpsa_jax.commands import common
from palimpsa_jax.training import train_and_evaluate


def _define_flags():
    config_flags.DEFINE_config_file("config", None, "Experiment file, path.py[:arg].")
    flags.DEFINE_string("workdir", None, "Directory of the run (checkpoints, logs).")
    flags.DEFINE_bool("resume", False, "Continue the run in --workdir from its last checkpoint.")
    flags.mark_flags_as_required(["config", "workdir"])


def _main():
    f = flags.FLAGS
    final = train_and_evaluate(f.config, f.workdir, resume=f.resume)
    for name, value in sorted(final.items()):
        print(f"{name:32s} {value:.4f}" if isinstance(value, float) else f"{name:32s} {value}")


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
