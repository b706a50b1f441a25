"""Runs of the project's commands as subprocesses, for the benchmarks that chain them
(`surgery_in_small`, `zoo_on_text`): start, wait with a log each, run in batches, read a run's
final metrics."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

# --small: a model and budget a CPU runs in minutes (the numbers mean nothing).
SMALL = ("--config.model.n_layers=4", "--config.model.d_model=64", "--config.data.seq_len=64",
         "--config.batch_size=4", "--config.eval.batch_size=4")
SMALL_STEPS = ("--config.train.steps=4", "--config.optim.warmup_steps=1")


def command(module: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m palimpsa_jax.commands.<module> args`, its output piped."""
    return subprocess.Popen([sys.executable, "-m", f"palimpsa_jax.commands.{module}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def wait(processes: dict[str, subprocess.Popen], logs: pathlib.Path) -> None:
    """Waits for every process, writes logs/<name>.log, and exits naming the failed ones."""
    failed = []
    for name, process in processes.items():
        output, _ = process.communicate()
        (logs / f"{name}.log").write_text(output)
        if process.returncode:
            failed.append(f"{name} (exit {process.returncode}, log {logs / f'{name}.log'})")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


def in_batches(jobs: dict[str, tuple], parallel: int, logs: pathlib.Path, env: dict) -> None:
    """jobs: name -> (module, *args), run `parallel` at a time."""
    names = list(jobs)
    for start in range(0, len(names), parallel):
        wait({name: command(*jobs[name], env=env) for name in names[start:start + parallel]}, logs)


def shared_memory(parallel: int) -> dict:
    """The environment of `parallel` processes on one accelerator: each takes its share."""
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.8 / parallel:.2f}"} if parallel > 1 else {}


def resume(run: pathlib.Path) -> tuple[str, ...]:
    """("--resume",) for a run that holds a checkpoint to continue from, else ()."""
    checkpoints = run / "checkpoints"
    return ("--resume",) if checkpoints.is_dir() and any(checkpoints.iterdir()) else ()


def metrics(run: pathlib.Path) -> dict:
    """The run's final metrics (metrics.json, written when training ends), {} before."""
    path = run / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def add_arguments(parser) -> None:
    """The arguments every chained benchmark takes: --corpus, --root, --parallel, --length,
    --small, --output."""
    parser.add_argument("--corpus", type=pathlib.Path, required=True, help="a palimpsa-prepare output directory")
    parser.add_argument("--root", type=pathlib.Path, required=True, help="directory of the runs")
    parser.add_argument("--parallel", type=int, default=1, help="trainings (and evaluations) at once")
    parser.add_argument("--length", type=int, default=4096, help="positions of the loss by position")
    parser.add_argument("--small", action="store_true", help="a tiny model and budget (CPU smoke run)")
    parser.add_argument("--output", type=pathlib.Path, help="also write the Markdown table here")


def workspace(args) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path, dict]:
    """corpus and root (absolute), root/logs (made), and the processes' environment."""
    corpus, root = args.corpus.resolve(), args.root.resolve()
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return corpus, root, logs, shared_memory(args.parallel)
