r"""palimpsa-eval: evaluate a checkpoint of a run on new settings, without resuming training.

    palimpsa-eval --workdir runs/mqar_palimpsa_d [--step 500] \
        [--config.data.eval_slices='((256, 16), (512, 32))'] [--config.data.test_path=other.npy]

`--config.<key>=<value>` overrides any key of the run's own config (its config.json; an
unknown key is an error): MQAR lengths and pair counts beyond training (`data.eval_slices`), a
text corpus (`data.test_path`), the evaluation batch. Prints the metrics and writes them to
runs/X/eval_<step>.json. Also `python -m palimpsa_jax.commands.evaluate`.
"""
from __future__ import annotations

import json
import pathlib
import sys

from absl import flags
from ml_collections import ConfigDict, config_flags

from palimpsa_jax import sharding
from palimpsa_jax.analysis.run import run_config
from palimpsa_jax.commands import common
from palimpsa_jax.training import checkpoint
from palimpsa_jax.training.trainer import Trainer


def evaluate(workdir, config, step: int | None = None) -> tuple[int, dict[str, float]]:
    """The evaluation metrics of the run's checkpoint with `config` (the run's config, changed
    where the new evaluation differs)."""
    trainer = Trainer(config)
    ckpt = checkpoint.Checkpoints(workdir, every_steps=0, keep=1, async_save=False)
    try:
        with sharding.use_mesh(trainer.mesh, trainer.rules):
            step, state, _ = ckpt.restore(trainer.abstract_state, step)
            return int(step), trainer.evaluate(state)
    finally:
        ckpt.close()


def _workdir_from(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _main():
    f = flags.FLAGS
    workdir = pathlib.Path(f.workdir)
    step, results = evaluate(workdir, f.config, f.step)
    for name, value in sorted(results.items()):
        print(f"{name:40s} {value:.4f}")
    (workdir / f"eval_{step}.json").write_text(json.dumps({"step": step, **results}, indent=2))


def main():
    workdir = _workdir_from(sys.argv[1:])
    try:        # the run's config is the base the --config.<key> overrides apply to
        base = run_config(workdir) if workdir else None
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    flags.DEFINE_string("workdir", None, "Directory of the run.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.mark_flag_as_required("workdir")
    config_flags.DEFINE_config_dict("config", base if base is not None else ConfigDict(),
                                    "The run's config; override keys with --config.<key>=<value>.")
    common.run(_main)


if __name__ == "__main__":
    main()
