"""Grids: the paper's MQAR grid and recipe, point names, overrides, replicas trained together
(equal to each alone, early stop and resume per replica), results, and the command line."""
import csv
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from benchmarks import mqar_curves
from palimpsa_jax.analysis import load_run
from palimpsa_jax.analysis.run import run_config
from palimpsa_jax.commands.evaluate import evaluate
from palimpsa_jax.data import write_corpus
from palimpsa_jax.data.mqar import MQARSource
from palimpsa_jax.evaluation import mqar_report
from palimpsa_jax.experiments.lm import palimpsa_d as lm_experiment
from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.experiments.mqar import sweep as mqar_sweep
from palimpsa_jax.training import ConfigError, grid, replicas

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWEEP_FILE = str(ROOT / "experiments/mqar/sweep.py")
# A tiny MQAR point: 1 layer of d_model 32, 16 tokens with 2 pairs, vocabulary 32.
TINY = {"train.steps": 6, "batch_size": 8, "data.num_train": 64, "data.num_test": 16,
        "data.vocab_size": 32, "model.vocab_size": 32, "data.seq_len": 16, "data.num_pairs": 2,
        "data.eval_slices": [[16, 2]], "eval.batch_size": 16, "eval.every_steps": 2,
        "log.progress": False, "log.every_steps": 1, "log.diagnostics_every_steps": 0,
        "checkpoint.every_steps": 2, "checkpoint.async_save": False, "model.n_layers": 1,
        "model.d_model": 32, "model.num_heads": 2, "model.head_dim": 8,
        "optim.warmup_steps": 0, "optim.clip_norm": 0.0}


def tiny(seed: int, lr: float, **changes):
    (point,) = grid.apply_overrides([common.cpu("palimpsa_d")],
                                    {**TINY, "seed": seed, "optim.lr": lr, **changes})
    return point


def losses(run_dir) -> list[float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines if "train/loss" in line]


def test_paper_grid_is_the_authors_recipe():
    points = grid.load_grid(SWEEP_FILE + ":paper")
    names = grid.point_names(points)
    assert len(points) == 5 * 2 * 4 * 8 == len(set(names))
    assert names[0] == "mixer=palimpsa_d,seq_len=512,lr=0.001,seed=1"
    assert names[-1] == "mixer=gated_deltanet,seq_len=1024,lr=0.01,seed=8"
    lrs = np.logspace(np.log10(1e-3), np.log10(1e-2), 4)
    assert {(grid.mixer_label(p), p.data.seq_len, p.optim.lr, p.seed) for p in points} == {
        (m, s, float(lr), seed) for m in ("palimpsa_d", "palimpsa_d_off", "palimpsa_m", "mamba2",
                                          "gated_deltanet")
        for s in (512, 1024) for lr in lrs for seed in range(1, 9)}
    for p in points:
        pairs, batch = {512: (128, 128), 1024: (256, 64)}[p.data.seq_len]
        epoch = -(-100_000 // batch)
        assert (p.data.num_pairs, p.batch_size, p.data.vocab_size) == (pairs, batch, 8192)
        assert (p.data.num_train, p.data.num_test, p.data.power_a) == (100_000, 3_000, 0.01)
        assert p.train.steps == 60 * epoch and p.train.early_stop_accuracy == 0.99
        assert p.eval.every_steps == p.optim.schedule_every_steps == epoch
        o = p.optim
        assert (o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm, o.warmup_steps) == (
            0.9, 0.999, 1e-8, 0.1, 0.0, 0)
        assert o.decay_every_parameter and o.schedule == "cosine" and o.min_lr_ratio == 0.0
        m = p.model
        assert (m.d_model, m.n_layers, m.mlp_hidden, m.beta_rank, m.final_norm) == (
            128, 2, 0, 8, "layernorm")
        assert (m.forget_init, m.a_min, m.a_max, m.dt_min, m.dt_max) == ("ramp", 0.01, 0.16,
                                                                         1e-3, 1e-1)
        assert m.init_std == m.conv_init_std == pytest.approx(128**-0.5)
        if grid.mixer_label(p) in ("mamba2", "palimpsa_m"):
            assert (m.ssm_head_dim, m.ssm_state, m.ssm_groups, m.ssm_bias, m.ssm_conv_bias) == (
                32, 16, 8, True, False)
        else:
            assert (m.num_heads, m.head_dim, m.expand_v) == (8, 16, 2)
    assert len(replicas.group_points(points)) == 10       # 4 learning rates x 8 seeds each


def test_paper_grid_options_and_errors():
    points = grid.load_grid(SWEEP_FILE + ":paper,seeds=1,lengths=512")
    assert len(points) == 5 * 4 and {p.data.seq_len for p in points} == {512}
    assert {p.seed for p in points} == {1}
    part = mqar_sweep.get_sweep("paper,seeds=2,lengths=1024,lrs=1+3,epochs=8,mixers=mamba2+palimpsa_m")
    assert [(grid.mixer_label(p), p.optim.lr, p.seed) for p in part] == [
        (m, lr, s) for m in ("mamba2", "palimpsa_m") for lr in common.PAPER_LRS[1::2]
        for s in (1, 2)]
    assert {(p.train.steps, p.optim.schedule_every_steps) for p in part} == {(8 * 1563, 1563)}
    later = mqar_sweep.get_sweep("paper,seeds=2-3,lengths=1024,lrs=1,mixers=palimpsa_d")
    assert [p.seed for p in later] == [2, 3]
    for bad in ("paper,seed=1", "paper,mixers=lstm", "paper,lengths=2048", "paper,seeds=3-2",
                "paper,seeds=two", "paper,seeds=9-12", "paper,seeds=-3"):
        with pytest.raises(ValueError, match="config argument"):
            mqar_sweep.get_sweep(bad)


def test_overrides_apply_to_every_point():
    points = grid.apply_overrides(grid.load_grid(SWEEP_FILE + ":paper,seeds=2"),
                                  {"train.steps": 7, "model.chunk_size": 16})
    assert {(p.train.steps, p.model.chunk_size) for p in points} == {(7, 16)}
    assert len(set(grid.point_names(points))) == 80
    for key, value in [("train.stepz", 3), ("optimx.lr", 3e-3), ("train.steps", "many")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            grid.apply_overrides(points, {key: value})


def test_materialised_examples_are_the_sources():
    data = tiny(0, 1e-2).data
    tokens, labels = replicas.materialise(data, "train", 16, 2, workers=2)
    source = MQARSource("train", 64, 32, 16, 2, data.seed, data.power_a)
    for i in (0, 17, 63):
        np.testing.assert_array_equal(tokens[i], source[i]["tokens"])
        np.testing.assert_array_equal(labels[i], source[i]["labels"])


def assert_own_checkpoints(workdir, names, finals):
    """Each replica's own checkpoint is at its last step and evaluates to its final metrics."""
    for name, final in zip(names, finals):
        step, metrics = evaluate(workdir / name, run_config(workdir / name))
        assert step == final["step"] == load_run(workdir / name).step
        assert metrics["eval/seq16_pairs2/loss"] == pytest.approx(
            final["eval/seq16_pairs2/loss"], rel=1e-5)


def test_two_replicas_together_equal_each_alone(tmp_path):
    """Every logged metric of a 2-replica vmapped run equals that replica's run alone; with an
    early stop between their first accuracies, the replica that stops keeps its metrics of that
    step and the other trains on unchanged."""
    points = [tiny(0, 3e-3), tiny(1, 2e-2)]
    together = replicas.train_group(points, [tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    for name, point in zip("ab", points):
        alone = replicas.train_group([point], [tmp_path / f"{name}1"], tmp_path / f"{name}g")
        np.testing.assert_allclose(losses(tmp_path / name), losses(tmp_path / f"{name}1"),
                                   rtol=2e-5)
        final = together["ab".index(name)]
        for key in ("eval/accuracy", "eval/seq16_pairs2/loss", "train/loss", "step"):
            assert final[key] == pytest.approx(alone[0][key], rel=2e-5), key

    assert_own_checkpoints(tmp_path, "ab", together)

    first = [json.loads(line) for name in "ab"
             for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
             if '"eval/accuracy"' in line and json.loads(line)["step"] == 2]
    low, high = sorted(r["eval/accuracy"] for r in first)
    if low == high:
        pytest.skip("both replicas have the same first accuracy")     # not seen with these seeds
    stopped = [tiny(0, 3e-3, **{"train.early_stop_accuracy": (low + high) / 2}),
               tiny(1, 2e-2, **{"train.early_stop_accuracy": (low + high) / 2})]
    finals = replicas.train_group(stopped, [tmp_path / "c", tmp_path / "d"], tmp_path / "cd")
    early = [r["eval/accuracy"] for r in first].index(high)
    assert finals[early]["step"] == 2 and finals[early]["train/stopped_early"] == 1.0
    assert finals[1 - early]["step"] == 6 and "train/stopped_early" not in finals[1 - early]
    np.testing.assert_allclose(losses(tmp_path / "cd"[1 - early]), losses(tmp_path / "ab"[1 - early]),
                               rtol=2e-5)
    assert_own_checkpoints(tmp_path, "cd", finals)


def test_each_pass_is_a_permutation_drawn_from_the_seed():
    """The order a replica's batches come in: step s takes batch s mod P of pass s // P, and pass
    p is the permutation of fold_in(seed, p) (3 passes of P = 8 batches, 2 seeds)."""
    group = replicas.ReplicaGroup([tiny(0, 1e-2), tiny(5, 1e-2)])
    assert group.batches_per_pass == 8
    tokens, labels = group.train_data
    for r, seed in enumerate((0, 5)):
        for step in (0, 7, 8, 13, 16, 23):
            order = jax.random.permutation(jax.random.fold_in(jax.random.key(seed), step // 8), 64)
            index = order[step % 8 * 8:(step % 8 + 1) * 8]
            batch = group._batch(group.pass_orders(step)[r], step)
            np.testing.assert_array_equal(batch["tokens"], tokens[index])
            np.testing.assert_array_equal(batch["labels"], labels[index])


def test_the_loop_trains_each_step_on_its_pass_order(tmp_path):
    """Over 20 steps (2.5 passes of 8 batches) the losses `train_group` logs are those of steps
    taken by hand, each on the permutation of fold_in(seed, step // 8) drawn in the test."""
    points = [tiny(0, 1e-2, **{"train.steps": 20}), tiny(5, 3e-3, **{"train.steps": 20})]
    replicas.train_group(points, [tmp_path / "a", tmp_path / "b"], tmp_path / "g")
    group = replicas.ReplicaGroup(points)
    state, by_hand = group.init_state(), []
    for step in range(20):
        orders = np.stack([jax.random.permutation(jax.random.fold_in(jax.random.key(seed),
                                                                     step // 8), 64)
                           for seed in (0, 5)])
        state, step_metrics = group.train_step(state, orders)
        by_hand.append(np.asarray(step_metrics["loss"]))
    np.testing.assert_allclose(np.stack([losses(tmp_path / "a"), losses(tmp_path / "b")], 1),
                               np.stack(by_hand), rtol=1e-6)


def test_a_group_of_one_stops_early_and_stays_stopped(tmp_path):
    """A lone replica (trained unbatched) stops at the first evaluation above its threshold; run
    again from its checkpoint of that step, it trains no further."""
    point = tiny(0, 2e-2, **{"train.early_stop_accuracy": 1e-6})
    (final,) = replicas.train_group([point], [tmp_path / "a"], tmp_path / "g")
    assert final["step"] == 2 and final["train/stopped_early"] == 1.0
    (tmp_path / "a" / "metrics.json").unlink()
    (again,) = replicas.train_group([point], [tmp_path / "a"], tmp_path / "g")
    assert again["step"] == 2 and again["eval/accuracy"] == final["eval/accuracy"]
    assert len(losses(tmp_path / "a")) == 2
    assert_own_checkpoints(tmp_path, "a", [again])


def test_an_interrupted_group_resumes(tmp_path):
    points = [tiny(0, 1e-2), tiny(1, 1e-2)]
    dirs = [tmp_path / "a", tmp_path / "b"]
    whole = replicas.train_group(points, dirs, tmp_path / "g")
    expected = [losses(d) for d in dirs]
    shutil.rmtree(tmp_path / "g" / "checkpoints" / "6")       # as if killed after step 4
    for d in dirs:
        (d / "metrics.json").unlink()
    resumed = replicas.train_group(points, dirs, tmp_path / "g")
    assert [losses(d) for d in dirs] == expected
    for d in dirs:      # one line per start: the fresh one, then the resume from step 4
        starts = [json.loads(s) for s in (d / "environment.jsonl").read_text().splitlines()]
        assert [s["step"] for s in starts] == [0, 4]
    for a, b in zip(resumed, whole):
        assert a["eval/accuracy"] == b["eval/accuracy"] and a["step"] == b["step"] == 6


def test_sigterm_stops_a_group_after_its_step_and_it_resumes(tmp_path, monkeypatch):
    """SIGTERM during step 3 (between the periodic checkpoints of steps 2 and 4): the group
    writes its checkpoint of step 3, raises Preempted and puts the previous handler back; run
    again, it ends with the losses and accuracies of an uninterrupted group."""
    points = [tiny(0, 1e-2), tiny(1, 1e-2)]
    whole = replicas.train_group(points, [tmp_path / "a", tmp_path / "b"], tmp_path / "g")
    expected = [losses(tmp_path / d) for d in ("a", "b")]

    class SignalledAtStep3(replicas.ReplicaGroup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            train_step, calls = self.train_step, []

            def step(state, orders):
                calls.append(1)
                if len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                return train_step(state, orders)
            self.train_step = step

    def event_writer_threads():
        return [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"]

    monkeypatch.setattr(replicas, "ReplicaGroup", SignalledAtStep3)
    dirs, handler = [tmp_path / "c", tmp_path / "d"], signal.getsignal(signal.SIGTERM)
    writer_threads = event_writer_threads()
    with pytest.raises(replicas.preemption.Preempted, match="SIGTERM after step 3: checkpoint "
                       "written in") as stopped:
        replicas.train_group(points, dirs, tmp_path / "g2")
    assert stopped.value.step == 3 and signal.getsignal(signal.SIGTERM) == handler
    assert event_writer_threads() == writer_threads      # its TensorBoard writers are closed
    assert max(int(p.name) for p in (tmp_path / "g2" / "checkpoints").iterdir()) == 3
    assert [losses(d) for d in dirs] == [e[:3] for e in expected]
    assert not any((d / "metrics.json").exists() for d in dirs)

    monkeypatch.undo()
    resumed = replicas.train_group(points, dirs, tmp_path / "g2")
    assert [losses(d) for d in dirs] == expected
    for d in dirs:
        starts = [json.loads(s)["step"] for s in (d / "environment.jsonl").read_text().splitlines()]
        assert starts == [0, 3]
    for a, b in zip(resumed, whole):
        assert a["eval/accuracy"] == b["eval/accuracy"] and a["step"] == b["step"] == 6


def test_replicas_of_a_group_may_differ_only_in_seed_and_rate():
    with pytest.raises(ConfigError, match=r"differ only in .*batch_size"):
        replicas.ReplicaGroup([tiny(0, 1e-2), tiny(0, 1e-2, batch_size=16)])


def test_mqar_grid_end_to_end_with_seeds(tmp_path, capsys):
    points = grid.apply_overrides(grid.load_grid(SWEEP_FILE)[:4], TINY)   # palimpsa_d: 2 lr x 2 seeds
    names = grid.point_names(points)
    assert names == ["lr=0.003,seed=0", "lr=0.003,seed=1", "lr=0.01,seed=0", "lr=0.01,seed=1"]
    rows = grid.run_grid(points, tmp_path)
    assert "training 4 replica(s) as one program" in capsys.readouterr().out
    assert [r["name"] for r in rows] == names
    for name in ("results.csv", "results.md", "accuracy.png", "sweep.json"):
        assert (tmp_path / name).stat().st_size > 0
    with (tmp_path / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    for row, name in zip(table, names):
        final = json.loads((tmp_path / name / "metrics.json").read_text())
        assert float(row["eval/seq16_pairs2/accuracy"]) == final["eval/seq16_pairs2/accuracy"]
        assert int(row["step"]) == final["step"] == 6
    markdown = (tmp_path / "results.md").read_text()
    best = markdown.split("## Best learning rate")[1]
    accuracies = {n: json.loads((tmp_path / n / "metrics.json").read_text())[
        "eval/seq16_pairs2/accuracy"] for n in names}
    means = {lr: np.mean([accuracies[f"lr={lr},seed={s}"] for s in (0, 1)]) for lr in ("0.003", "0.01")}
    lr = max(means, key=means.get)
    spread = [accuracies[f"lr={lr},seed={s}"] for s in (0, 1)]
    assert (f"| palimpsa_d | seq16_pairs2 | {float(lr):.4g} | {means[lr]:.4f} | "
            f"{min(spread):.4f}-{max(spread):.4f} | 2 |") in best
    # the paper's figure over workdirs (benchmarks/mqar_curves.py) reads the same results
    assert mqar_curves.figure([tmp_path], tmp_path / "figure.png") == (
        "\n## Best learning rate" + best.replace("accuracy.png", "figure.png"))
    assert (tmp_path / "figure.png").stat().st_size > 0
    # ... and so does the figure drawn from results.csv alone (the run folders gone)
    assert mqar_curves.figure([], tmp_path / "figure.png", [tmp_path / "results.csv"]) == (
        "\n## Best learning rate" + best.replace("accuracy.png", "figure.png"))
    for bad in ([str(tmp_path)], ["--results", str(tmp_path / "results.csv")], []):
        with pytest.raises(SystemExit):
            mqar_curves.main(bad)
    mqar_curves.main([str(tmp_path), "--out", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert grid.run_grid(points, tmp_path) == rows           # everything finished: skipped
    with pytest.raises(ConfigError, match=r"data\.seed"):
        grid.run_grid(grid.apply_overrides(points, {"data.seed": 1}), tmp_path)


def test_an_mqar_point_alone_in_its_group_trains_as_a_group_of_one(tmp_path, capsys):
    """A grid of two MQAR points of different models (batch sizes): each is a group of one
    replica, and its logged losses and final metrics equal its own `train_group` run, so a
    point's result does not depend on the grid it is run in."""
    points = [tiny(0, 1e-2), tiny(1, 3e-3, batch_size=16)]
    rows = grid.run_grid(points, tmp_path / "grid")
    out = capsys.readouterr().out
    names = grid.point_names(points)
    assert all(f"training 1 replica(s) as one program: {n}" in out for n in names)
    for point, name, row in zip(points, names, rows):
        (alone,) = replicas.train_group([point], [tmp_path / name], tmp_path / f"{name}_g")
        assert losses(tmp_path / "grid" / name) == losses(tmp_path / name)
        assert row["eval/accuracy"] == alone["eval/accuracy"] and row["step"] == alone["step"]
    # a point the replicas cannot train (micro-batches) runs through the trainer's loop
    (accumulated,) = grid.apply_overrides(points[:1], {"train.grad_accum": 2})
    (row,) = grid.run_grid([accumulated], tmp_path / "accumulated")
    assert "replica(s) as one program" not in capsys.readouterr().out
    assert row["step"] == 6 and (tmp_path / "accumulated" / "point" / "checkpoints").is_dir()


def test_best_learning_rate_is_chosen_on_the_seeds_every_rate_has_run():
    """A rate run on seeds 1-3 (0.9, 0.1, 0.1) against one run on seed 1 alone (0.5): compared
    on seed 1, the first wins (a lone lucky seed does not beat a mean over three) and is
    reported over its three seeds; where no seed is common, the means over all seeds decide."""
    key = "eval/seq16_pairs2/accuracy"
    rows = [{"mixer": "m", "optim.lr": 1e-3, "seed": s, key: a}
            for s, a in ((1, 0.9), (2, 0.1), (3, 0.1))]
    rows.append({"mixer": "m", "optim.lr": 1e-2, "seed": 1, key: 0.5})
    (best,) = mqar_report.best_learning_rates(rows, ["seq16_pairs2"])
    assert (best["optim.lr"], best["seeds"], best["min"], best["max"]) == (1e-3, 3, 0.1, 0.9)
    assert best["mean"] == pytest.approx(1.1 / 3)
    rows[-1]["seed"] = 4                                     # no seed in common
    (best,) = mqar_report.best_learning_rates(rows, ["seq16_pairs2"])
    assert (best["optim.lr"], best["mean"], best["seeds"]) == (1e-2, 0.5, 1)


def test_the_figure_from_results_never_mixes_two_schedules(tmp_path):
    """A results CSV with points of an 8- and a 60-epoch cosine (its `epochs` column): the
    figure of either schedule holds that schedule's points alone, and with no schedule chosen,
    or one that no row has, it refuses, naming --epochs."""
    key = "eval/seq512_pairs128/accuracy"
    results = tmp_path / "points.csv"
    results.write_text(f"mixer,optim.lr,seed,{key},epochs,session\n"
                       "mamba2,0.001,1,0.5,8,a\nmamba2,0.001,2,0.7,8,a\nmamba2,0.002,1,0.9,60,b\n")
    short = mqar_curves.figure([], tmp_path / "f8.png", [results], epochs=8)
    assert "| mamba2 | seq512_pairs128 | 0.001 | 0.6000 | 0.5000-0.7000 | 2 |" in short
    full = mqar_curves.figure([], tmp_path / "f60.png", [results], epochs=60)
    assert "| mamba2 | seq512_pairs128 | 0.002 | 0.9000 | 0.9000-0.9000 | 1 |" in full
    with pytest.raises(ValueError, match=r"several schedules \(epochs \[8, 60\]\).*--epochs"):
        mqar_curves.figure([], tmp_path / "f.png", [results])
    with pytest.raises(ValueError, match="--epochs 7: no row"):
        mqar_curves.figure([], tmp_path / "f.png", [results], epochs=7)
    for bad in (["--results", str(results), "--figure", str(tmp_path / "f.png")],
                ["--epochs", "8", "--figure", str(tmp_path / "f.png")]):
        with pytest.raises(SystemExit):
            mqar_curves.main(bad)


def test_text_grid_runs_point_after_point(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, 64, size=rng.integers(3, 30)).tolist() for _ in range(32)]
    write_corpus(tmp_path / "train.npy", documents, eos_id=2)
    points = []
    for lr in (1e-3, 3e-3):
        c = lm_experiment.get_config()
        c.model.update(vocab_size=64, d_model=32, n_layers=1, num_heads=2, head_dim=16,
                       mlp_hidden=32, beta_rank=4)
        c.data.update(path=str(tmp_path / "train.npy"), test_path=str(tmp_path / "train.npy"),
                      seq_len=16)
        c.batch_size, c.train.steps, c.optim.lr, c.optim.warmup_steps = 2, 2, lr, 1
        c.log.update(progress=False, diagnostics_every_steps=0)
        c.eval.update(every_steps=0, batch_size=2)
        points.append(c)
    rows = grid.run_grid(points, tmp_path / "grid")
    assert [r["name"] for r in rows] == ["lr=0.001", "lr=0.003"]
    assert all(np.isfinite(r["eval/accuracy"]) and r["step"] == 2 for r in rows)
    assert not (tmp_path / "grid" / "accuracy.png").exists()      # no MQAR slices


def test_command_line_rejects_unknown_key(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "palimpsa_jax.commands.sweep", "--config", SWEEP_FILE, "--workdir",
         str(tmp_path), "--config.train.stepz=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--config.train.stepz: unknown config key" in result.stderr


SWEEP_FILES = sorted(p for p in (ROOT / "experiments").rglob("*.py")
                     if "get_sweep" in p.read_text())


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_sweep_file_gives_valid_points(path):
    """Every grid an experiment file defines passes the launcher's config checks, and its points
    have distinct names (so no two share a run directory)."""
    from palimpsa_jax.training import check_config
    points = grid.load_grid(str(path))
    for point in points:
        check_config(point, {"data": 1, "fsdp": 1, "tensor": 1})
    names = grid.point_names(points)
    assert len(set(names)) == len(points)
