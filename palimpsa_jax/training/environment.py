"""What a run ran on: `workdir/environment.jsonl`, one line per process start (a fresh run, then
each resume), so a number that does not reproduce can be traced to the machine or a version.

On a CPU the compiled arithmetic follows the instruction set XLA targets (README, "MQAR": the
default job's accuracy moves with `--xla_cpu_max_isa`), so the CPU's vector extensions are
recorded beside the devices, the package versions, the code's commit and the `XLA_*` / `JAX_*`
variables.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
from collections import Counter
from collections.abc import Sequence

import jax

PACKAGES = ("palimpsa-jax", "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax",
            "optax", "orbax-checkpoint", "numpy", "ml-collections", "grain", "tensorboard")
# CPU flags that change which kernels XLA's CPU backend emits
ISA_PREFIXES = ("sse4", "avx", "fma", "amx", "f16c")


def _cpu() -> tuple[str, list[str]]:
    """(model name, vector-extension flags) from /proc/cpuinfo, or platform's answer elsewhere."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = dict(line.split(":", 1) for line in lines if ":" in line)   # the last core's
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(ISA_PREFIXES))
    return fields.get("model name", platform.machine()), flags


def _commit() -> str | None:
    """The git commit of the package's source ("+dirty" if it has uncommitted changes), or None
    outside a git checkout."""
    source = pathlib.Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():     # installed, or copied without its repository
        return None
    try:
        run = lambda *args: subprocess.run(["git", "-C", str(source), *args], capture_output=True,
                                           text=True, timeout=10, check=True).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = run("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def versions(names: Sequence[str] = PACKAGES) -> dict[str, str]:
    """{distribution name: installed version} of those of `names` that are installed."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def describe() -> dict:
    """This process's machine and software as a JSON-able dict."""
    cpu, isa = _cpu()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_isa": isa,
        "cpu_count": os.cpu_count(),
        "devices": dict(Counter(d.device_kind for d in jax.devices())),
        "process_count": jax.process_count(),
        "packages": versions(),
        "commit": _commit(),
        "variables": {k: v for k, v in sorted(os.environ.items())
                      if k.startswith(("XLA_", "JAX_"))},
    }


def record(workdirs: Sequence[pathlib.Path], step: int) -> None:
    """Appends {"step": the step this process starts from, "time": UTC, **describe()} to each
    workdir's environment.jsonl."""
    line = json.dumps({"step": int(step), "time": datetime.datetime.now(
        datetime.UTC).isoformat(timespec="seconds"), **describe()})
    for workdir in workdirs:
        with open(pathlib.Path(workdir) / "environment.jsonl", "a") as f:
            f.write(line + "\n")
