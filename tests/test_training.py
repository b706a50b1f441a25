"""The training system: the launcher, sharded steps, checkpoints, logging, configs.

Runs that need their own process (8 simulated devices, SIGKILL) go through the real command
line, `python -m palimpsa_jax.commands.train` (palimpsa-train), on a tiny MQAR config.
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from palimpsa_jax.data import make_dataset
from palimpsa_jax.data.mqar import IGNORE, MQARSource
from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.models import CausalLM
from palimpsa_jax.training import ConfigError, Trainer, check_config, train_and_evaluate
from palimpsa_jax.training.checkpoint import CheckpointError
from palimpsa_jax.training.optim import param_groups
from palimpsa_jax.training.trainer import scored_metrics, scored_positions

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXPERIMENT = ROOT / "experiments" / "mqar" / "palimpsa_d.py"

# A tiny MQAR run: 2 layers of Palimpsa-D, d_model 64, 4 heads of 16, vocabulary 64.
TINY = {
    "model.vocab_size": 64, "model.d_model": 64, "model.num_heads": 4, "model.head_dim": 16,
    "model.expand_v": 1, "model.beta_rank": 8, "model.chunk_size": 16,
    "data.vocab_size": 64, "data.seq_len": 32, "data.num_pairs": 4, "data.num_train": 512,
    "data.num_test": 32, "data.eval_slices": ((32, 4),),
    "batch_size": 16, "train.steps": 6, "optim.warmup_steps": 2,
    "log.every_steps": 1, "log.diagnostics_every_steps": 3, "log.progress": False,
    "eval.every_steps": 3, "eval.batch_size": 16, "checkpoint.every_steps": 2,
}


def tiny_config(**changes):
    config = common.cpu("palimpsa_d")
    for key, value in {**TINY, **changes}.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config)[name] = value
    return config


def cli(workdir, *, devices=1, resume=False, **changes) -> subprocess.Popen:
    """The launcher in a fresh process on `devices` simulated CPU devices."""
    flags = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
             for k, v in {**TINY, **changes}.items()]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "palimpsa_jax.commands.train", f"--config={EXPERIMENT}",
               f"--workdir={workdir}", *flags] + (["--resume"] if resume else [])
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return out


def records(workdir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def losses(workdir) -> np.ndarray:
    return np.array([r["train/loss"] for r in records(workdir) if "train/loss" in r])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One in-process tiny run (6 steps, checkpoints every 2, eval and diagnostics every 3)."""
    workdir = tmp_path_factory.mktemp("tiny")
    final = train_and_evaluate(tiny_config(), workdir)
    return workdir, final


def test_run_writes_config_metrics_checkpoints(tiny_run):
    workdir, final = tiny_run
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["model"]["d_model"] == 64 and saved["train"]["steps"] == 6
    assert json.loads((workdir / "metrics.json").read_text()) == pytest.approx(final)
    assert {"eval/accuracy", "eval/seq32_pairs4/accuracy", "train/loss", "step"} <= set(final)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4, 6]
    assert [r["step"] for r in records(workdir) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert np.all(np.isfinite(losses(workdir)))


def test_run_records_its_environment(tiny_run):
    """environment.jsonl: one line for the fresh start, this process's versions and devices."""
    (line,) = [json.loads(s) for s in (tiny_run[0] / "environment.jsonl").read_text().splitlines()]
    assert line["step"] == 0
    assert line["packages"]["jax"] == jax.__version__ and line["packages"]["flax"] == flax.__version__
    assert line["devices"] == {jax.devices()[0].device_kind: len(jax.devices())}
    assert line["python"] == platform.python_version() and line["cpu_count"] == os.cpu_count()
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = set(next(s for s in cpuinfo.read_text().splitlines()
                         if s.startswith("flags")).split(":", 1)[1].split())
        assert line["cpu_isa"] and set(line["cpu_isa"]) <= flags
        assert ("avx2" in flags) == ("avx2" in line["cpu_isa"])
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert line["commit"].removesuffix("+dirty") == head


def test_tensorboard_tags(tiny_run):
    workdir, _ = tiny_run
    events = EventAccumulator(str(workdir / "tensorboard"),
                              size_guidance={"scalars": 0, "histograms": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/accuracy", "train/learning_rate", "train/grad_norm",
                "train/tokens_per_s", "eval/accuracy", "eval/seq32_pairs4/accuracy"}
    for layer in ("00", "01"):
        for stat in ("importance_mean", "importance_min", "importance_max",
                     "importance_over_prior_min", "metaplasticity_ratio", "memory_window",
                     "b_scale"):
            expected |= {f"metaplasticity/layer_{layer}/{stat}/head_{h:02d}" for h in range(4)}
            expected.add(f"metaplasticity/layer_{layer}/{stat}/mean")
    assert expected <= tags, sorted(expected - tags)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("metaplasticity/layer_00/importance_mean/head_00")] == [3, 6]
    assert events.Scalars("metaplasticity/layer_00/memory_window/head_00")[-1].value >= 1.0
    # the importance starts at the prior and only accumulates evidence or relaxes back to it:
    # I >= prior for every synapse of every head (float32 rounding allowed)
    for layer in ("00", "01"):
        for head in range(4):
            ratio = events.Scalars(
                f"metaplasticity/layer_{layer}/importance_over_prior_min/head_{head:02d}")[-1].value
            assert ratio >= 1 - 1e-6, (layer, head, ratio)
    # histograms: log10(I / prior) over every synapse of the batch's final memories (16
    # sequences x 4 heads x 16 x 16), and the prior of each layer
    histograms = set(events.Tags()["histograms"])
    for layer in ("00", "01"):
        for name in ("log10_importance_over_prior", "prior"):
            tag = f"metaplasticity/layer_{layer}/{name}"
            assert tag in histograms, tag
            assert [e.step for e in events.Histograms(tag)] == [3, 6]
        counts = events.Histograms(f"metaplasticity/layer_{layer}/log10_importance_over_prior")
        assert counts[-1].histogram_value.num == 16 * 4 * 16 * 16


def test_resume_needs_a_checkpoint(tmp_path, tiny_run):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        train_and_evaluate(tiny_config(), tmp_path / "empty", resume=True)
    workdir = tmp_path / "no_checkpoints"
    workdir.mkdir()
    shutil.copy(tiny_run[0] / "config.json", workdir)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        train_and_evaluate(tiny_config(), workdir, resume=True)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tiny_run):
    workdir = tmp_path / "corrupt"
    shutil.copytree(tiny_run[0], workdir)
    for f in (workdir / "checkpoints" / "6" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0" * 7)
    with pytest.raises(CheckpointError, match=r"checkpoints/6 could not be restored"):
        train_and_evaluate(tiny_config(**{"train.steps": 8}), workdir, resume=True)


def test_existing_run_is_not_overwritten(tiny_run):
    with pytest.raises(ConfigError, match="already holds checkpoints: pass --resume"):
        train_and_evaluate(tiny_config(), tiny_run[0])


def test_resume_refuses_a_changed_config(tiny_run, tmp_path):
    workdir = tmp_path / "changed"
    shutil.copytree(tiny_run[0], workdir)
    with pytest.raises(ConfigError, match=r"differs .* in \['optim.lr'\]"):
        train_and_evaluate(tiny_config(**{"optim.lr": 0.5}), workdir, resume=True)


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    changes = {"train.steps": 3, "log.diagnostics_every_steps": 0, "eval.every_steps": 0,
               "checkpoint.async_save": False}
    train_and_evaluate(tiny_config(**changes), tmp_path / "full")
    train_and_evaluate(tiny_config(**changes, **{"train.grad_accum": 4}), tmp_path / "accum")
    np.testing.assert_allclose(losses(tmp_path / "accum"), losses(tmp_path / "full"), rtol=2e-5)


@pytest.mark.parametrize("key, value, message", [
    ("optim.lr", -1e-3, "optim.lr must be > 0"),
    ("model.mixers", ("palimpsa_x",), "model: mixers: mixer 'palimpsa_x' is not registered"),
    ("train.grad_accum", 3, r"batch_size \(16\) must be divisible by mesh.data x mesh.fsdp x train.grad_accum"),
    ("mesh.tensor", 2, r"mesh.data = -1: the other axes \(2 devices\) do not divide the 1 devices"),
    ("data.kind", "images", "data.kind must be one of"),
    ("data.vocab_size", 128, r"data.vocab_size \(128\) must equal model.vocab_size"),
    ("optim.schedule", "step", "optim.schedule must be one of"),
    ("sharding.rules", [["heads", "model"]], "sharding.rules: 'heads' maps to 'model'"),
    ("sharding.rules", [["batch", "data"]], r"sharding.rules has no rule for the logical axes \['heads'\]"),
    ("optim.warmup_steps", 7, r"optim.warmup_steps \(7\) must not exceed train.steps \(6\)"),
    ("train.early_stop_accuracy", 1.5, "train.early_stop_accuracy must be in"),
    ("model.forget_init", "constant", "model: forget_init must be one of"),
    ("model.prior_family", "column", "model: prior_family must be one of"),
])
def test_bad_config_fails_before_compiling(monkeypatch, key, value, message):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before the config was checked")
    monkeypatch.setattr(jax, "jit", no_compile)
    with pytest.raises(ConfigError, match=message):
        Trainer(tiny_config(**{key: value}))


def test_batch_must_divide_over_data_axis():
    """On a mesh of 8 along data (checked against the mesh the config will run on)."""
    with pytest.raises(ConfigError, match=r"batch_size \(12\) must be divisible by mesh.data x "
                                          r"mesh.fsdp x train.grad_accum \(8 x 1 x 1\)"):
        check_config(tiny_config(batch_size=12), {"data": 8, "fsdp": 1, "tensor": 1})


def test_heads_must_divide_over_the_tensor_axis():
    config = tiny_config(**{"model.num_heads": 3, "model.head_dim": 16, "mesh.tensor": 2})
    with pytest.raises(ConfigError, match=r"model.num_heads \(3\) must be divisible by the mesh "
                                          r"axes of 'heads' \(tensor: 2 devices\)"):
        check_config(config, {"data": 4, "fsdp": 1, "tensor": 2})


def test_unknown_override_key_is_an_error(tmp_path):
    process = cli(tmp_path / "typo", **{"optim.lrr": 1e-3})
    _, err = process.communicate(timeout=300)
    assert process.returncode != 0 and "lrr" in err


def test_bad_config_value_is_one_line_naming_the_key(tmp_path):
    """A config error on the command line: status 2 and one line naming the key, no traceback;
    before that, nothing was written."""
    process = cli(tmp_path / "bad", **{"optim.warmup_steps": 100})
    _, err = process.communicate(timeout=300)
    assert process.returncode == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: optim.warmup_steps (100) must not exceed train.steps")
    assert "Traceback" not in err and not (tmp_path / "bad").exists()


def test_early_stop_after_an_evaluation_above_the_threshold(tmp_path):
    final = train_and_evaluate(tiny_config(**{"train.early_stop_accuracy": 1e-9,
                                              "log.diagnostics_every_steps": 0}), tmp_path)
    assert final["step"] == 3 and final["train/stopped_early"] == 1.0   # first evaluation: step 3
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())[-1] == 3


def test_metaplastic_parameters_have_their_own_group():
    trainer = Trainer(tiny_config())
    params = trainer.abstract_state["params"]
    groups = {jax.tree_util.keystr(path): group for path, group in
              jax.tree_util.tree_leaves_with_path(param_groups(params))}
    metaplastic = {path for path, group in groups.items() if group == "metaplastic"}
    assert metaplastic and all(any(name in path for name in ("W_b1", "W_b2", "b_scale"))
                               for path in metaplastic)
    assert any("W_q" in p for p, g in groups.items() if g == "default")


def test_metaplastic_learning_rate_scales_only_its_group():
    """One step with optim.metaplastic_lr = lr / 1000: the metaplastic parameters move 1000x less
    than with metaplastic_lr = lr (to float32 rounding of parameters near 1), every other
    parameter exactly as much."""
    def deltas(metaplastic_lr):
        trainer = Trainer(tiny_config(**{"optim.metaplastic_lr": metaplastic_lr,
                                         "optim.warmup_steps": 0, "optim.weight_decay": 0.0}))
        state = trainer.init_state()
        before = jax.tree.map(np.asarray, state["params"])
        batch = next(iter(make_dataset(trainer.config.data, split="train", batch_size=16, seed=0)))
        state, _ = trainer.train_step(state, trainer.global_batch(batch))
        moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state["params"], before)
        groups = param_groups(state["params"])
        return {jax.tree_util.keystr(p): (g, m) for (p, g), m in zip(
            jax.tree_util.tree_leaves_with_path(groups), jax.tree.leaves(moved))}

    lr = tiny_config().optim.lr
    same, slow = deltas(lr), deltas(lr / 1000)
    assert same.keys() == slow.keys()
    for path, (group, moved) in same.items():
        if group == "metaplastic":
            assert slow[path][1] == pytest.approx(moved / 1000, rel=0.02), path
        else:
            assert slow[path][1] == moved, path


# The runs of the mesh tests. The constant schedule gives every step the same learning rate
# whatever train.steps, so a run of 4 steps is the first 4 steps of a run of 6.
MESH_RUN = {"optim.schedule": "constant", "checkpoint.every_steps": 4, "eval.every_steps": 4,
            "log.diagnostics_every_steps": 2}
MESHES = {"data4_tensor2": {"mesh.data": 4, "mesh.tensor": 2},
          "fsdp4_tensor2": {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2},
          "data2_fsdp2_tensor2": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}}


def run_on_mesh(workdir, name: str, steps: int) -> str:
    """A MESH_RUN of `steps` steps on 8 simulated devices, mesh MESHES[name]; its output."""
    mesh = MESHES[name]
    out = finish(cli(workdir, devices=8, **MESH_RUN, **{"train.steps": steps}, **mesh))
    sizes = {axis: mesh.get(f"mesh.{axis}", 1) for axis in ("data", "fsdp", "tensor")}
    assert (f"{workdir.name}: 8 cpu device(s) in 1 process(es); mesh data {sizes['data']} x fsdp "
            f"{sizes['fsdp']} x tensor {sizes['tensor']};") in out, out
    assert "M parameters; 512 tokens per step (16 x 32)" in out
    return out


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """The single-device reference of the mesh tests: 6 steps, checkpoints and evaluations at
    steps 4 and 6, diagnostics every 2."""
    workdir = tmp_path_factory.mktemp("one_device")
    finish(cli(workdir, **MESH_RUN, **{"train.steps": 6}))
    return workdir


@pytest.fixture(scope="module")
def data4_tensor2_run(tmp_path_factory):
    """4 steps on 8 devices, mesh data 4 x tensor 2 (its last checkpoint: step 4)."""
    workdir = tmp_path_factory.mktemp("mesh") / "data4_tensor2"
    run_on_mesh(workdir, "data4_tensor2", 4)
    return workdir


def eval_accuracy(workdir, step: int) -> float:
    (accuracy,) = [r["eval/accuracy"] for r in records(workdir) if r["step"] == step and "eval/accuracy" in r]
    return accuracy


def test_eight_devices_match_one(tmp_path, one_device_run, data4_tensor2_run):
    """data x tensor, fsdp x tensor and data x fsdp x tensor meshes give the single-device loss
    trajectory (float32 tolerance) and evaluation."""
    for name in MESHES:
        workdir = data4_tensor2_run if name == "data4_tensor2" else tmp_path / name
        if name != "data4_tensor2":
            run_on_mesh(workdir, name, 4)
        assert len(losses(workdir)) == 4
        np.testing.assert_allclose(losses(workdir), losses(one_device_run)[:4], rtol=1e-4,
                                   err_msg=name)
        final = json.loads((workdir / "metrics.json").read_text())
        assert final["step"] == 4
        assert final["eval/accuracy"] == pytest.approx(eval_accuracy(one_device_run, 4), abs=1e-6)


INTERRUPTED = {"train.steps": 40, "checkpoint.every_steps": 4, "eval.every_steps": 20,
               "log.diagnostics_every_steps": 0}


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """The uninterrupted 40-step run that the interrupted ones are compared with."""
    workdir = tmp_path_factory.mktemp("whole")
    finish(cli(workdir, **INTERRUPTED))
    return workdir


def wait_for(path: pathlib.Path, process: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while not path.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)


def assert_resumes_as_uninterrupted(workdir, whole, **changes):
    """--resume of the run in workdir gives the uninterrupted run's metrics at every step,
    in metrics.jsonl and in TensorBoard (every step once)."""
    finish(cli(workdir, resume=True, **changes))
    resumed, expected = records(workdir), records(whole)
    assert [r["step"] for r in resumed] == [r["step"] for r in expected]
    for a, b in zip(resumed, expected):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-6, err_msg=str(a["step"]))
    for tag in ("train/loss", "eval/accuracy"):
        events = [EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0},
                                   purge_orphaned_data=False).Reload().Scalars(tag)
                  for run in (workdir, whole)]
        steps = [e.step for e in events[0]]
        assert steps == [e.step for e in events[1]] and len(steps) == len(set(steps)), tag
        np.testing.assert_allclose([e.value for e in events[0]], [e.value for e in events[1]],
                                   rtol=1e-6)


def test_killed_run_resumes_step_for_step(tmp_path, whole_run):
    """SIGKILL after the checkpoint of step 8, then --resume: the same metrics at every step as
    an uninterrupted run (data iterator included)."""
    killed = cli(tmp_path, **INTERRUPTED)
    wait_for(tmp_path / "checkpoints" / "8", killed)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    done = [r["step"] for r in records(tmp_path) if "train/loss" in r]
    assert 8 <= done[-1] < 40

    assert_resumes_as_uninterrupted(tmp_path, whole_run, **INTERRUPTED)
    starts = [json.loads(s) for s in (tmp_path / "environment.jsonl").read_text().splitlines()]
    assert len(starts) == 2 and starts[0]["step"] == 0
    assert 8 <= starts[1]["step"] <= done[-1] and starts[1]["step"] % 4 == 0
    assert all(s["variables"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
               for s in starts)


def test_sigterm_writes_a_checkpoint_and_resumes_step_for_step(tmp_path, whole_run):
    """SIGTERM mid-run (no periodic checkpoints): the run writes a checkpoint after the step it
    is in, exits with status 143 and one line saying so; --resume continues from that step with
    the uninterrupted run's metrics."""
    changes = {**INTERRUPTED, "checkpoint.every_steps": 0}
    stopped = cli(tmp_path, **changes)
    wait_for(tmp_path / "environment.jsonl", stopped)     # written once the handler is in place
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=600)
    assert stopped.returncode == 128 + signal.SIGTERM, err[-3000:]
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    step = int(checkpoint.name)
    assert 1 <= step < 40
    assert f"stopped: SIGTERM after step {step}: checkpoint written in" in err
    assert [r["step"] for r in records(tmp_path) if "train/loss" in r] == list(range(1, step + 1))
    assert not (tmp_path / "metrics.json").exists()

    assert_resumes_as_uninterrupted(tmp_path, whole_run, **changes)
    starts = [json.loads(s)["step"] for s in (tmp_path / "environment.jsonl").read_text().splitlines()]
    assert starts == [0, step]


PREEMPTED_PROCESS = """
import sys, time
import jax
jax.distributed.initialize(f"localhost:{sys.argv[1]}", 2, int(sys.argv[2]))
from palimpsa_jax.training import preemption
with preemption.StopOnSigterm() as sigterm:
    print("ready", flush=True)
    step = next(s for s in range(1, 100_000) if time.sleep(0.01) or sigterm.requested(s))
print("stop", step)
"""


def test_processes_of_a_run_stop_at_the_same_step_on_sigterm():
    """Two processes of one jax.distributed run, SIGTERM to one of them: both are told to stop,
    at the same step (JAX's preemption service; no handler of ours replaces its notifier)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    processes = [subprocess.Popen([sys.executable, "-c", PREEMPTED_PROCESS, str(port), str(i)],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in processes] == ["ready", "ready"]
        time.sleep(0.5)
        processes[1].send_signal(signal.SIGTERM)
        results = [p.communicate(timeout=120) for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in results]
    (stop,) = {out.strip() for out, _ in results}
    assert stop.startswith("stop ") and int(stop.split()[1]) > 1


def test_language_model_on_a_local_corpus(tmp_path):
    """experiments/lm/palimpsa_d.py on packed documents (segment ids): trains, evaluates
    perplexity on the test corpus, logs diagnostics."""
    from palimpsa_jax.data import write_corpus
    from palimpsa_jax.experiments.lm import palimpsa_d as experiment
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, 128, size=rng.integers(3, 40)).tolist() for _ in range(64)]
    write_corpus(tmp_path / "train.npy", documents, eos_id=2)
    write_corpus(tmp_path / "test.npy", documents[:6], eos_id=2)
    config = experiment.get_config()
    config.model.update(vocab_size=128, d_model=32, n_layers=2, num_heads=2, head_dim=16,
                        mlp_hidden=64, beta_rank=4)
    config.data.update(path=str(tmp_path / "train.npy"), test_path=str(tmp_path / "test.npy"),
                       seq_len=32)
    config.batch_size, config.train.steps, config.optim.warmup_steps = 4, 3, 1
    config.log.update(every_steps=1, diagnostics_every_steps=3, progress=False)
    config.eval.update(every_steps=0, batch_size=4)
    final = train_and_evaluate(config, tmp_path / "run")
    assert np.isfinite(final["eval/perplexity"]) and final["eval/perplexity"] > 1
    assert final["eval/perplexity"] == pytest.approx(np.exp(final["eval/loss"]))
    assert losses(tmp_path / "run").shape == (3,)
    with pytest.raises(ConfigError, match="data.path must name the training corpus"):
        Trainer(experiment.get_config())


def test_checkpoint_restores_onto_another_mesh(tmp_path, one_device_run, data4_tensor2_run):
    """The checkpoint of step 4 of a single-device run, resumed on 8 devices (data 4 x tensor 2)
    to step 6, and the reverse: the losses of the uninterrupted single-device run (float32
    tolerance)."""
    grow, shrink = tmp_path / "grow", tmp_path / "shrink"
    # the single-device run as if it had stopped after its checkpoint of step 4
    shutil.copytree(one_device_run, grow)
    shutil.rmtree(grow / "checkpoints" / "6")
    (grow / "metrics.json").unlink()
    (grow / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(grow) if r["step"] <= 4))
    finish(cli(grow, devices=8, resume=True, **MESH_RUN, **{"train.steps": 6}, **MESHES["data4_tensor2"]))
    shutil.copytree(data4_tensor2_run, shrink)
    finish(cli(shrink, resume=True, **MESH_RUN, **{"train.steps": 6}))
    for workdir in (grow, shrink):
        assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [4, 6]
        assert len(losses(workdir)) == 6
        np.testing.assert_allclose(losses(workdir), losses(one_device_run), rtol=1e-4,
                                   err_msg=workdir.name)


@given(st.integers(1, 4), st.integers(1, 24), st.data())
def test_scored_positions_are_the_scored_tokens_in_order(rows, length, data):
    """Rows with exactly `count` scored labels give their positions; a row with fewer gives all
    of them, padded with unscored positions."""
    count = data.draw(st.integers(1, length))
    labels = np.full((rows, length), IGNORE, np.int32)
    for row in labels:
        scored = data.draw(st.integers(0, count))
        row[np.sort(np.random.default_rng(scored).permutation(length)[:scored])] = 7
    positions = np.asarray(scored_positions(jnp.asarray(labels), count))
    assert positions.shape == (rows, count)
    for row, pos in zip(labels, positions):
        scored = np.flatnonzero(row != IGNORE)
        np.testing.assert_array_equal(pos[:len(scored)], scored)
        assert np.all(row[pos[len(scored):]] == IGNORE)


def test_scored_logits_give_the_full_loss_and_gradients():
    """An MQAR batch: the loss, accuracy and parameter gradients from the logits of the scored
    positions alone equal those from every position's logits."""
    config = tiny_config()
    model_config = check_config(config, {"data": 1, "fsdp": 1, "tensor": 1})
    graphdef, params, rest = nnx.split(CausalLM(model_config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    source = MQARSource("train", 8, 64, 32, 4, seed=0)
    batch = {name: jnp.stack([source[i][name] for i in range(8)]) for name in ("tokens", "labels")}

    def loss(params, count):
        total, correct, scored = scored_metrics(nnx.merge(graphdef, params, rest), batch, count)
        return total, (correct, scored)

    # jitted, as the train step computes them (op by op, the two passes take 30 s on 2 CPU cores)
    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (full, (correct, scored)), full_grads = value_and_grad(params, None)
    (part, aux), part_grads = value_and_grad(params, 4)
    assert int(scored) == 32 and (int(correct), int(scored)) == tuple(map(int, aux))
    np.testing.assert_allclose(part, full, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(part_grads), jax.tree.leaves(full_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
