"""Sweeps: grid expansion and point names, overrides, and a tiny grid run end to end (CPU)."""
import csv
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from palimpsa_jax.training import sweep

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWEEP_FILE = str(ROOT / "experiments/mqar/sweep.py")
TINY = {"train.steps": 3, "batch_size": 8, "data.num_train": 64, "data.num_test": 16,
        "data.seq_len": 16, "data.num_pairs": 2, "data.eval_slices": [[16, 2]],
        "eval.batch_size": 16, "log.progress": False, "log.diagnostics_every_steps": 0,
        "checkpoint.every_steps": 2, "checkpoint.async_save": False, "model.n_layers": 1,
        "model.d_model": 32}


def test_paper_grid():
    points = sweep.load_sweep(SWEEP_FILE + ":paper")
    names = sweep.point_names(points)
    assert len(points) == 32 and len(set(names)) == 32
    assert names[0] == "mixer=palimpsa_d,seq_len=512,lr=0.001"
    assert names[-1] == "mixer=gated_deltanet,seq_len=1024,lr=0.01"
    lrs = np.logspace(np.log10(1e-3), np.log10(1e-2), 4)
    grid = {(sweep.mixer_label(p), p.data.seq_len, p.optim.lr) for p in points}
    assert grid == {(m, s, float(lr)) for m in ("palimpsa_d", "palimpsa_d_off", "mamba2",
                                                 "gated_deltanet")
                    for s in (512, 1024) for lr in lrs}
    for p in points:
        pairs, batch = {512: (128, 128), 1024: (256, 64)}[p.data.seq_len]
        assert (p.data.num_pairs, p.batch_size) == (pairs, batch)
        assert [list(s) for s in p.data.eval_slices] == [[p.data.seq_len, pairs]]
        assert p.train.steps * p.batch_size == points[0].train.steps * 128   # same epochs
        assert p.model.metaplasticity == (sweep.mixer_label(p) != "palimpsa_d_off")
    columns = sweep._column_values(points)[0]
    assert list(columns) == ["mixer", "data.seq_len", "data.num_pairs", "optim.lr", "batch_size",
                             "data.eval_slices", "train.steps"]


def test_cpu_grid_and_first_point():
    points = sweep.load_sweep(SWEEP_FILE)
    assert len(points) == 4
    assert sweep.point_names(points)[0] == "mixer=palimpsa_d,lr=0.003"
    spec = importlib.util.spec_from_file_location("mqar_sweep", SWEEP_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config().to_dict() == points[0].to_dict()     # what train.py would run


def test_overrides_apply_to_every_point():
    points = sweep.apply_overrides(sweep.load_sweep(SWEEP_FILE + ":paper"),
                                   {"train.steps": 7, "model.chunk_size": 16})
    assert {(p.train.steps, p.model.chunk_size) for p in points} == {(7, 16)}
    assert len(set(sweep.point_names(points))) == 32     # train.steps no longer varies
    with pytest.raises(ValueError, match="train.stepz"):
        sweep.apply_overrides(points, {"train.stepz": 3})
    with pytest.raises(ValueError, match="optimx.lr"):
        sweep.apply_overrides(points, {"optimx.lr": 3e-3})
    with pytest.raises(ValueError, match="train.steps"):
        sweep.apply_overrides(points, {"train.steps": "many"})


def test_summarize_interrupted_paper_grid(tmp_path):
    """Tables and best learning rates from the metrics.json files of the points that finished."""
    points = sweep.load_sweep(SWEEP_FILE + ":paper")
    names = sweep.write_grid(points, tmp_path)
    finished = {}
    for name, p in zip(names, points):
        mixer, lr = sweep.mixer_label(p), p.optim.lr
        if p.data.seq_len == 512 and mixer in ("palimpsa_d", "mamba2") or name == names[4]:
            accuracy = 0.5 + 10 * lr if mixer == "palimpsa_d" else 0.5 - 10 * lr
            s = f"seq{p.data.seq_len}_pairs{p.data.num_pairs}"
            finished[name] = {f"eval/{s}/accuracy": accuracy, f"eval/{s}/loss": 1.0,
                              "eval/accuracy": accuracy, "train/loss": 2.0, "step": 10}
            (tmp_path / name).mkdir()
            (tmp_path / name / "metrics.json").write_text(json.dumps(finished[name]))
    rows = sweep.summarize(tmp_path)
    assert [r["name"] for r in rows] == list(finished) and len(rows) == 9
    with (tmp_path / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0])[:7] == ["name", "mixer", "data.seq_len", "data.num_pairs", "optim.lr",
                                  "batch_size", "data.eval_slices"]
    assert (table[0]["eval/seq512_pairs128/accuracy"], table[0]["eval/seq1024_pairs256/accuracy"]
            ) == (str(0.5 + 10 * 1e-3), "")
    markdown = (tmp_path / "results.md").read_text()
    assert "Not finished (23)" in markdown
    best = markdown.split("## Best learning rate")[1].split("Not finished")[0]
    assert f"| palimpsa_d | seq512_pairs128 | 0.01 | 0.6000 | {names[3]} |" in best
    assert f"| palimpsa_d | seq1024_pairs256 | 0.001 | 0.5100 | {names[4]} |" in best
    assert f"| mamba2 | seq512_pairs128 | 0.001 | 0.4900 | {names[16]} |" in best
    assert "gated_deltanet" not in best and (tmp_path / "accuracy.png").stat().st_size > 0


def test_command_line_rejects_unknown_key(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "palimpsa_jax.sweep", "--config", SWEEP_FILE, "--workdir",
         str(tmp_path), "--config.train.stepz=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--config.train.stepz: unknown config key" in result.stderr


def test_tiny_sweep_end_to_end(tmp_path, capsys):
    points = sweep.apply_overrides(sweep.load_sweep(SWEEP_FILE)[:2], TINY)   # palimpsa_d x 2 lr
    names = sweep.point_names(points)
    assert names == ["lr=0.003", "lr=0.01"]
    rows = sweep.run_sweep(points, tmp_path)
    assert [r["name"] for r in rows] == names
    for name in ("results.csv", "results.md", "accuracy.png", "sweep.json"):
        assert (tmp_path / name).stat().st_size > 0
    with (tmp_path / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["name"] for r in table] == names
    markdown = (tmp_path / "results.md").read_text()
    for row, name in zip(table, names):
        final = json.loads((tmp_path / name / "metrics.json").read_text())
        assert row["mixer"] == "palimpsa_d" and float(row["optim.lr"]) == float(name[3:])
        for key in ("eval/seq16_pairs2/accuracy", "eval/accuracy", "train/loss"):
            assert float(row[key]) == final[key]
        assert int(row["step"]) == final["step"] == 3
        assert f"| {name} | palimpsa_d |" in markdown
    assert "## Best learning rate per (mixer, slice)" in markdown
    assert "| palimpsa_d | seq16_pairs2 |" in markdown

    # A second run skips the finished point and resumes the interrupted one (checkpoint of step 2,
    # no metrics.json) to the same final metrics.
    (tmp_path / names[1] / "metrics.json").unlink()
    shutil.rmtree(tmp_path / names[1] / "checkpoints" / "3")
    capsys.readouterr()
    assert sweep.run_sweep(points, tmp_path) == rows
    out = capsys.readouterr().out
    assert f"{names[0]}: finished before, skipped" in out and f"{names[1]}: resuming" in out

    changed = sweep.apply_overrides(points, {"data.seed": 1})
    with pytest.raises(ValueError, match=r"data\.seed"):
        sweep.run_sweep(changed, tmp_path)
