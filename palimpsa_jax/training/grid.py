"""Grids of experiments: the configs of an experiment file, run point after point, and the table
of their results.

An experiment file may define `get_sweep(arg=None) -> list[ConfigDict]`, the complete config of
every grid point (big_vision style; `path.py:arg` passes arg). `run_grid(points, workdir)`
trains each point in workdir/<name>, the name listing the keys that vary across the grid
(`mixer=palimpsa_d,seq_len=512,lr=0.001`; keys that follow from the ones before are left out);
MQAR grids train the replicas that share a model together (`palimpsa_jax.training.replicas`).
A point whose metrics.json exists is skipped (an error if its config.json differs from the
point other than in log/checkpoint/eval.every_steps), one with checkpoints but no metrics.json
is resumed. `summarize(workdir)` rebuilds the results from the points' metrics.json files, also
after an interrupted grid.

Files in the workdir:
- sweep.json: the grid, {"columns": [key, ...], "points": [{"name": ..., "values": {key: value}}]}
  (columns: "mixer", optim.lr and every other key that varies);
- <name>/: one run each (config.json, metrics.json, and the run's checkpoints and logs);
- results.csv: one row per finished point: name, the columns, eval/<slice>/accuracy for every
  evaluation slice (empty where a point has no such slice), eval/accuracy, train/loss, step;
- results.md: the same as a Markdown table, then for MQAR grids the best learning rate per
  (mixer, slice) over seeds, and accuracy.png (`palimpsa_jax.evaluation.mqar_report`).
"""
from __future__ import annotations

import copy
import csv
import hashlib
import importlib.util
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections

from palimpsa_jax.evaluation import mqar_report
from palimpsa_jax.training import replicas
from palimpsa_jax.training.config import ConfigError, changed_keys, flatten
from palimpsa_jax.training.trainer import train_and_evaluate

MIXER = "mixer"   # the column derived from model.mixers and model.metaplasticity
LR = "optim.lr"
# Name and column order: these first, the other varying keys after them in sorted order.
KEY_ORDER = (MIXER, "data.seq_len", "data.num_pairs", LR)
# Keys that do not change a finished run's results (a finished point may differ in them).
NO_EFFECT = ("log", "checkpoint", "eval.every_steps")
FINAL = ("eval/accuracy", "train/loss", "step")


# --- the grid -------------------------------------------------------------------------------

def load_grid(spec: str) -> list[ml_collections.ConfigDict]:
    """The points of `path.py[:arg]`: get_sweep(arg) of that file (get_sweep() without arg)."""
    path, *arg = spec.split(":", 1)
    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"sweep file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location("sweep_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"sweep file {path} defines no get_sweep(arg)")
    points = module.get_sweep(*arg)
    if not points or not all(isinstance(p, ml_collections.ConfigDict) for p in points):
        raise ConfigError(f"get_sweep({', '.join(map(repr, arg))}) of {path} must return a "
                          f"non-empty list of ConfigDicts")
    return list(points)


def apply_overrides(points: Sequence[ml_collections.ConfigDict],
                    overrides: Mapping[str, Any]) -> list[ml_collections.ConfigDict]:
    """Copies of the points (locked) with every `dotted.key: value` of `overrides` set.

    The values are typed (the command line's are parsed by ml_collections' config flags);
    a key that a point lacks, or a value of the wrong type, raises ConfigError naming the key.
    """
    result = []
    for point in points:
        point = copy.deepcopy(point)
        point.lock()
        for key, value in overrides.items():
            try:
                point.update_from_flattened_dict({key: value})
            except (KeyError, AttributeError) as e:
                detail = str(e.args[0] if e.args else e).replace("\n", "; ")
                raise ConfigError(f"override {key!r}: no such config key ({detail})") from None
            except TypeError as e:
                raise ConfigError(f"override {key!r}: {e}") from None
        result.append(point)
    return result


def mixer_label(config: ml_collections.ConfigDict) -> str:
    """`+`-joined model.mixers, with `_off` after Palimpsa mixers when metaplasticity is off
    (palimpsa_d, palimpsa_d_off, mamba2, gated_deltanet, mamba2+palimpsa_m, ...)."""
    off = not config.model.metaplasticity
    return "+".join(f"{m}_off" if off and m.startswith("palimpsa") else m
                    for m in config.model.mixers)


def _values(point: ml_collections.ConfigDict) -> dict[str, Any]:
    """Every key of the point (JSON values, as in its config.json), mixers as one `mixer`."""
    flat = flatten(json.loads(point.to_json_best_effort()))
    del flat["model.mixers"], flat["model.metaplasticity"]
    return {MIXER: mixer_label(point), **flat}


def _order(key: str) -> tuple:
    return (KEY_ORDER.index(key), "") if key in KEY_ORDER else (len(KEY_ORDER), key)


def _column_values(points: Sequence[ml_collections.ConfigDict]) -> list[dict[str, Any]]:
    """Per point, {key: value} of the keys that vary across the points, plus mixer and lr."""
    flats = [_values(p) for p in points]
    keys = sorted({k for f in flats for k in f}, key=_order)
    columns = [k for k in keys if k in (MIXER, LR) or
               len({json.dumps(f.get(k)) for f in flats}) > 1]
    return [{k: f.get(k) for k in columns} for f in flats]


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "-".join(_format(v) for v in value)
    return str(value)


def point_names(points: Sequence[ml_collections.ConfigDict]) -> list[str]:
    """`key=value,...` of the varying keys of each point, leaving out a key whose value follows
    from the keys named before it (e.g. num_pairs and batch_size when they follow seq_len);
    floats to 4 significant digits, `/` in values as `_`."""
    columns = _column_values(points)
    varying = [k for k in columns[0] if len({json.dumps(c[k]) for c in columns}) > 1]
    named = []
    for key in varying:
        by_named = {}
        for c in columns:
            by_named.setdefault(json.dumps([c[k] for k in named]), set()).add(json.dumps(c[key]))
        if any(len(values) > 1 for values in by_named.values()):
            named.append(key)
    short = [k.rsplit(".", 1)[-1] for k in named]
    labels = [s if short.count(s) == 1 else k for s, k in zip(short, named)]
    names = [",".join(f"{label}={_format(c[k])}".replace("/", "_")
                      for label, k in zip(labels, named)) or "point" for c in columns]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"grid points {names.index(name)} and {i} have the same name "
                              f"{name!r}: they are equal in every varying key (floats to 4 "
                              f"significant digits)")
    return names


# --- running --------------------------------------------------------------------------------

def _has_checkpoint(run_dir: pathlib.Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def _check_finished(point: ml_collections.ConfigDict, run_dir: pathlib.Path) -> None:
    """A finished run is reused only if its config.json is the point's (up to NO_EFFECT keys)."""
    changed = changed_keys(json.loads((run_dir / "config.json").read_text()),
                           json.loads(point.to_json_best_effort()), NO_EFFECT)
    if changed:
        raise ConfigError(f"{run_dir} holds a finished run whose config differs from this sweep "
                          f"point in {changed}: remove that directory or choose another workdir")


def write_grid(points: Sequence[ml_collections.ConfigDict], workdir) -> list[str]:
    """Writes workdir/sweep.json (what summarize reads) and returns the point names."""
    workdir = pathlib.Path(workdir)
    names, columns = point_names(points), _column_values(points)
    grid = {"columns": list(columns[0]),
            "points": [{"name": n, "values": v} for n, v in zip(names, columns)]}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "sweep.json").write_text(json.dumps(grid, indent=2) + "\n")
    return names


def run_grid(points: Sequence[ml_collections.ConfigDict], workdir) -> list[dict[str, Any]]:
    """Trains the unfinished points in workdir/<name> and returns summarize(workdir); the
    results files are rewritten after every point (or group of replicas).

    MQAR points of full batches (`replicas.trains`) train as replicas (`replicas.group_points`):
    those that differ only in seed and learning rate together, one vmapped program per group on
    one device, with the data set materialised once in workdir/data; a point alone in its group
    is a group of one, so a point's result does not depend on the grid it is run in. Other
    points train one after another with `train_and_evaluate`.
    """
    workdir = pathlib.Path(workdir)
    lead = jax.process_index() == 0
    names = write_grid(points, workdir) if lead else point_names(points)
    todo = []
    for i, (name, point) in enumerate(zip(names, points)):
        if (workdir / name / "metrics.json").exists():
            _check_finished(point, workdir / name)
            print(f"[{i + 1}/{len(points)}] {name}: finished before, skipped")
        else:
            todo.append(i)
    mqar = [i for i in todo if replicas.trains(points[i])]
    groups = [[mqar[g] for g in group] for group in replicas.group_points([points[i] for i in mqar])]
    for members in groups:
        key = json.dumps([names[i] for i in members]).encode()
        group_dir = workdir / "groups" / hashlib.sha256(key).hexdigest()[:12]
        print(f"training {len(members)} replica(s) as one program: "
              f"{', '.join(names[i] for i in members)}")
        finals = replicas.train_group([points[i] for i in members],
                                      [workdir / names[i] for i in members], group_dir,
                                      cache_dir=workdir / "data", desc=names[members[0]])
        for i, final in zip(members, finals):
            print(f"{names[i]}: " + ", ".join(f"{k}={_format(final[k])}" for k in FINAL
                                               if k in final))
        if lead:
            summarize(workdir)
    for i in (i for i in todo if i not in mqar):
        run_dir = workdir / names[i]
        resume = _has_checkpoint(run_dir)
        print(f"[{i + 1}/{len(points)}] {names[i]}: {'resuming' if resume else 'training'}")
        final = train_and_evaluate(points[i], run_dir, resume=resume)
        print(f"[{i + 1}/{len(points)}] {names[i]}: " + ", ".join(
            f"{k}={_format(final[k])}" for k in FINAL if k in final))
        if lead:
            summarize(workdir)
    return summarize(workdir) if lead else []


# --- results --------------------------------------------------------------------------------

def summarize(workdir) -> list[dict[str, Any]]:
    """Writes results.csv and results.md (and, for MQAR slices, the best-learning-rate table and
    accuracy.png) from workdir/sweep.json and the points' metrics.json files; returns the rows
    (one dict per finished point, keys as in the CSV)."""
    workdir = pathlib.Path(workdir)
    grid_path = workdir / "sweep.json"
    if not grid_path.exists():
        raise FileNotFoundError(f"{grid_path} does not exist: {workdir} is not a sweep workdir")
    grid = json.loads(grid_path.read_text())
    rows, unfinished = [], []
    for point in grid["points"]:
        metrics_path = workdir / point["name"] / "metrics.json"
        if metrics_path.exists():
            rows.append({"name": point["name"], **point["values"],
                         **json.loads(metrics_path.read_text())})
        else:
            unfinished.append(point["name"])
    slices = sorted({m[1] for row in rows for k in row
                     if (m := re.fullmatch(r"eval/(.+)/accuracy", k))}, key=mqar_report.slice_order)
    fields = ["name", *grid["columns"], *(f"eval/{s}/accuracy" for s in slices), *FINAL]
    rows = [{k: row.get(k) for k in fields} for row in rows]
    with (workdir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    header = ["point", *grid["columns"], *(f"accuracy {s}" for s in slices),
              "accuracy (all slices)", "train loss", "steps"]
    lines = [[row["name"], *(_format(row[c]) for c in grid["columns"]),
              *(mqar_report.cell(row[f"eval/{s}/accuracy"]) for s in slices),
              *(mqar_report.cell(row[k]) for k in FINAL)] for row in rows]
    text = "# Sweep results\n\n" + mqar_report.table(header, lines)
    text += mqar_report.report(rows, slices, workdir / "accuracy.png")
    if unfinished:
        text += f"\nNot finished ({len(unfinished)}): {', '.join(unfinished)}\n"
    (workdir / "results.md").write_text(text)
    return rows
