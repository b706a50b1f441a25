r"""palimpsa-eval: evaluate a checkpoint of a run on new settings, without resuming training.

    palimpsa-eval --workdir runs/mqar_palimpsa_d [--step 500] \
        [--config.data.eval_slices='((256, 16), (512, 32))'] [--config.data.test_path=other.npy]
    palimpsa-eval --workdir runs/lm_small --tasks piqa,hellaswag [--include_path DIR] \
        [--limit N] [--num_fewshot K] [--batch_size B] [--max_length L]

`--config.<key>=<value>` overrides any key of the run's own config (its config.json; an
unknown key is an error): MQAR lengths and pair counts beyond training (`data.eval_slices`), a
text corpus (`data.test_path`), the evaluation batch. Prints the metrics and writes them to
runs/X/eval_<step>.json.

`--tasks` instead evaluates the run's language model on lm-evaluation-harness tasks (names,
groups or tags; `--include_path` adds a folder of task YAML files) through the "palimpsa"
model of palimpsa_jax.evaluation.harness, prints lm-eval's tables and writes its results to
runs/X/lm_eval_<step>.json. The run's config is then not used for evaluating, so
`--config.<key>` overrides with `--tasks` are an error. Also `python -m palimpsa_jax.commands.evaluate`.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

from absl import app, flags
from ml_collections import ConfigDict, config_flags

from palimpsa_jax import sharding
from palimpsa_jax.analysis.run import run_config
from palimpsa_jax.commands import common
from palimpsa_jax.training import checkpoint
from palimpsa_jax.training.config import ConfigError
from palimpsa_jax.training.trainer import Trainer

# The flags of the lm-evaluation-harness evaluation (--tasks).
HARNESS_FLAGS = ("include_path", "limit", "num_fewshot", "batch_size", "max_length")


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


def evaluate_tasks(workdir, tasks: list[str], step: int | None = None, *,
                   include_path: str | None = None, limit: float | None = None,
                   num_fewshot: int | None = None, batch_size: int = 16,
                   max_length: int | None = None) -> tuple[int, dict]:
    """lm-evaluation-harness results (`simple_evaluate`'s dict, without samples) of the run's
    checkpoint on `tasks`; batch_size, max_length as `harness.PalimpsaLM`'s."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from palimpsa_jax.evaluation.harness import PalimpsaLM

    manager = TaskManager(include_path=include_path)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"tasks: unknown lm-eval tasks {unknown} (`lm-eval ls tasks` lists them; "
                          f"include_path adds a folder of task YAML files)")
    model = PalimpsaLM(workdir, step, batch_size=batch_size, max_length=max_length)
    results = simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                              task_manager=manager, log_samples=False)
    return model.run.step, results


def _workdir_from(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _main_tasks():
    f = flags.FLAGS
    if importlib.util.find_spec("lm_eval") is None:
        sys.exit('error: --tasks needs lm-evaluation-harness: pip install -e ".[eval]"')
    step, results = evaluate_tasks(f.workdir, f.tasks, f.step, include_path=f.include_path,
                                   limit=f.limit, num_fewshot=f.num_fewshot,
                                   batch_size=f.batch_size, max_length=f.max_length)
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    path = pathlib.Path(f.workdir) / f"lm_eval_{step}.json"
    path.write_text(json.dumps({"step": step, **results}, indent=2, default=handle_non_serializable))


def _main():
    f = flags.FLAGS
    if f.tasks:
        overrides = [arg.split("=", 1)[0] for arg in sys.argv[1:] if arg.startswith("--config.")]
        if overrides:
            raise app.UsageError(f"--tasks evaluates the run as it was trained: "
                                 f"{', '.join(overrides)} cannot be combined with it")
        return _main_tasks()
    harness_flags = [f"--{name}" for name in HARNESS_FLAGS if f[name].present]
    if harness_flags:
        raise app.UsageError(f"{', '.join(harness_flags)}: lm-evaluation-harness flags, given without --tasks")
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
    flags.DEFINE_list("tasks", None, "lm-evaluation-harness tasks to evaluate on instead "
                      "(comma-separated names, groups or tags).")
    flags.DEFINE_string("include_path", None, "With --tasks: a folder of further task YAML files.")
    flags.DEFINE_float("limit", None, "With --tasks: examples per task (a fraction if < 1).")
    flags.DEFINE_integer("num_fewshot", None, "With --tasks: few-shot examples (default: the task's).")
    flags.DEFINE_integer("batch_size", 16, "With --tasks: sequences per forward.", lower_bound=1)
    flags.DEFINE_integer("max_length", None, "With --tasks: most tokens per forward (default: "
                         "the run's data.seq_len).", lower_bound=1)
    flags.mark_flag_as_required("workdir")
    common.define_config(config_flags.DEFINE_config_dict, "config", base if base is not None else ConfigDict(),
                         "The run's config; override keys with --config.<key>=<value>.")
    common.run(_main)


if __name__ == "__main__":
    main()
