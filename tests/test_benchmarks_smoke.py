"""The train-step benchmark (`benchmarks/lm_step.py`): its CPU smoke run reports every model,
and its profile breakdown classes the device events of a GPU-like trace by the rules it states."""
import gzip
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import lm_step

ROOT = pathlib.Path(__file__).resolve().parents[1]
# CPU compiles of the four tiny models dominate the run; XLA's unoptimised CPU code halves them.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.mark.smoke
def test_smoke_small_run_reports_every_model(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_CPU_COMPILE}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.lm_step", "--small", "--profile-dir",
         str(tmp_path / "trace"), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    results = json.loads(out.read_text())
    assert [r["model"] for r in results["models"]] == [f"{m}-small" for m in lm_step.MODELS]
    for r in results["models"]:
        assert sum(row.startswith(f"| {r['model']} |") for row in rows) == 2   # timing, breakdown
        assert math.isfinite(r["ms_per_step"]) and r["ms_per_step"] > 0
        assert math.isfinite(r["ms_per_step_pipelined"]) and r["ms_per_step_pipelined"] > 0
        assert math.isfinite(r["loss"])
        profile = r["profile"]
        assert profile["top_ops"] and sum(profile["classes_ms"].values()) > 0
    assert results["models"][0]["profile"]["classes_ms"]["recurrent"] > 0
    assert results["models"][-1]["profile"]["classes_ms"]["attention"] > 0
    kernels = results["kernels"]
    assert {(k["op"], k["implementation"]) for k in kernels} >= {("gla", "ours xla"),
                                                                 ("gated_delta", "ours xla")}
    assert all(math.isfinite(k["fwd_ms"]) for k in kernels if "error" not in k)
    assert "fla: skipped" in result.stdout


HLO = """HloModule jit__train_step, is_scheduled=true

FileNames
1 "{kernels}/gla/chunk.py"
2 "{optax}/_src/transform.py"
3 "{root}/palimpsa_jax/models/lm.py"
FunctionNames
1 "gla_chunked"
2 "update_fn"
3 "CausalLM.__call__"
FileLocations
1 {{file_name_id=3 function_name_id=3 line=1 end_line=1 column=1 end_column=2}}
2 {{file_name_id=1 function_name_id=1 line=2 end_line=2 column=1 end_column=2}}
3 {{file_name_id=2 function_name_id=2 line=3 end_line=3 column=1 end_column=2}}
StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}
3 {{file_location_id=3 parent_frame_id=2}}

%fused_dot (param_0: f32[8,8]) -> f32[8,8] {{
  %param_0 = f32[8,8]{{1,0}} parameter(0)
  ROOT %dot.1 = f32[8,8]{{1,0}} dot(%param_0, %param_0), metadata={{stack_frame_id=2}}
}}

%fused_add (param_0.1: f32[8,8]) -> f32[8,8] {{
  %param_0.1 = f32[8,8]{{1,0}} parameter(0)
  ROOT %add.1 = f32[8,8]{{1,0}} add(%param_0.1, %param_0.1), metadata={{stack_frame_id=3}}
}}

ENTRY %main.9 (p.1: f32[8,8]) -> f32[8,8] {{
  %p.1 = f32[8,8]{{1,0}} parameter(0)
  %gemm_fusion_dot.1 = f32[8,8]{{1,0}} fusion(%p.1), kind=kCustom, calls=%fused_dot, metadata={{stack_frame_id=2}}
  %custom-call.3 = (f32[8,8]{{1,0}}, s8[64]{{0}}) custom-call(%p.1), custom_call_target="__cublas$gemm"
  %loop_add_fusion = f32[8,8]{{1,0}} fusion(%p.1), kind=kLoop, calls=%fused_add, metadata={{stack_frame_id=3}}
  ROOT %copy.2 = f32[8,8]{{1,0}} copy(%p.1)
}}
"""


def test_breakdown_classes_device_events(tmp_path):
    """Stream events only (not the derived XLA Ops line nor the host); an event is matched by its
    hlo_op, else by its kernel name; stacks through the kernels package are recurrent, through
    optax the optimizer; a cuBLAS call is a matmul, a copy a copy; host/idle is the wall time
    outside the union of the device intervals."""
    hlo = lm_step.Hlo(HLO.format(kernels=lm_step.KERNELS_DIR, optax=lm_step.OPTAX_DIR, root=ROOT))
    assert hlo.module == "jit__train_step"
    assert [f for _, f in hlo.stack(hlo.instructions["loop_add_fusion"].frame)] == [
        "update_fn", "CausalLM.__call__"]
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    module = {"hlo_module": "jit__train_step"}
    kernels = [("gemm_fusion_dot_1", "gemm_fusion_dot.1", 0, 3000),          # -> recurrent
               ("sm90_xmma_gemm_bf16bf16", "custom-call.3", 3000, 6000),    # -> matmul
               ("loop_add_fusion", "loop_add_fusion", 9000, 1500),          # -> optimizer
               ("copy_2", None, 12000, 1500)]                               # -> copies, by name
    events = [{"ph": "X", "pid": 1, "tid": 7, "name": k, "ts": ts, "dur": dur,
               "args": {**module, **({"hlo_op": op} if op else {})}} for k, op, ts, dur in kernels]
    events += [{"ph": "X", "pid": 1, "tid": 9, "name": "loop_add_fusion", "ts": 0, "dur": 9e4,
                "args": {**module, "hlo_op": "loop_add_fusion"}},
               {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction", "ts": 0, "dur": 9e4}]
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": meta + events}).encode()))

    steps = lm_step.PROFILED_STEPS
    result = lm_step.breakdown(tmp_path, hlo, wall_ms=20.0 / steps)
    per_step = lambda us: us / 1e3 / steps
    assert result["classes_ms"] == pytest.approx({
        **dict.fromkeys(lm_step.CLASSES, 0.0), "recurrent": per_step(3000), "matmul": per_step(6000),
        "optimizer": per_step(1500), "copies": per_step(1500)})
    assert result["device_busy_ms"] == pytest.approx(per_step(12000))
    assert result["host_idle_ms"] == pytest.approx(per_step(20000 - 12000))
    assert [o["op"] for o in result["top_ops"]] == ["custom-call.3", "gemm_fusion_dot.1",
                                                    "loop_add_fusion", "copy.2"]


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    """A corpus prepared by palimpsa-prepare from text the fixture writes, and the CPU env."""
    tmp_path = tmp_path_factory.mktemp("text_corpus")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        words = " ".join(f"word{(i * 7 + j * j) % 97}" for j in range(400))
        (texts / f"doc{i}.txt").write_text(f"document {i}: {words}\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_CPU_COMPILE}
    prepare = subprocess.run(
        [sys.executable, "-m", "palimpsa_jax.commands.prepare", "--input", str(texts / "*.txt"), "--output",
         str(tmp_path / "corpus"), "--train_tokenizer", "--vocab_size", "300", "--validation_fraction", "0.25",
         "--workers", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    return tmp_path / "corpus", env


@pytest.mark.smoke
def test_smoke_surgery_in_small_prints_its_table(tmp_path, text_corpus):
    """The surgery comparison end to end on a corpus prepared from text the test writes."""
    corpus, env = text_corpus
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.surgery_in_small", "--corpus", str(corpus), "--root",
         str(tmp_path / "runs"), "--small", "--seeds", "0", "--output", str(tmp_path / "table.md")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    assert "converts layers [0, 1, 2, 3]" in table          # weakest:4 of the 4-layer base
    control = json.loads((tmp_path / "runs" / "control_s0" / "metrics.json").read_text())
    assert "| 0 | " in table and f"{control['eval/loss']:.4f} |" in table
    assert table.count("\n| 1-1 |") == 1 and "passkey, best cell: surgery s0" in table


@pytest.mark.smoke
def test_smoke_zoo_on_text_reports_over_seeds(tmp_path, text_corpus):
    """The zoo end to end on a tiny budget: two mixers over two seeds, the table's losses are the
    runs' own (mean and spread over seeds), the evaluated seed's loss by position and passkey of
    both haystacks are the command's outputs, the plot is written; a second call runs nothing."""
    corpus, env = text_corpus
    command = [sys.executable, "-m", "benchmarks.zoo_on_text", "--corpus", str(corpus), "--root",
               str(tmp_path / "runs"), "--small", "--mixers", "gated_deltanet", "attention", "--seeds", "0", "1",
               "--parallel", "2", "--output", str(tmp_path / "table.md")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    runs = tmp_path / "runs"
    for mixer in ("gated_deltanet", "attention"):
        losses = [json.loads((runs / f"{mixer}_s{s}" / "metrics.json").read_text())["eval/loss"] for s in (0, 1)]
        assert losses[0] != losses[1]                       # the seeds differ
        assert (f"| {mixer} | {losses[0]:.4f} | {losses[1]:.4f} | {np.mean(losses):.4f} | "
                f"{abs(losses[0] - losses[1]):.4f} | {np.exp(np.mean(losses)):.2f} |") in table
        saved = json.loads((runs / f"{mixer}_s0" / "long_context" / "loss_by_position.json").read_text())
        assert "| 1-1 | " in table and f"{saved['buckets'][0]['mean_loss']:.4f}" in table
        for haystack in ("prose", "python"):
            passkey = json.loads((runs / f"{mixer}_s0" / "long_context" / f"passkey_{haystack}.json").read_text())
            assert passkey["haystack"] == haystack and passkey["lengths"] == [128]
        assert not (runs / f"{mixer}_s1" / "long_context").exists()
    assert table.count("passkey, ") == 2
    assert (runs / "loss_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stamps = {p: p.stat().st_mtime_ns for p in runs.glob("*/metrics.json")}
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and (tmp_path / "table.md").read_text() == table
    assert {p: p.stat().st_mtime_ns for p in runs.glob("*/metrics.json")} == stamps


@pytest.mark.smoke
@pytest.mark.parametrize("op", ["gla", "gated_delta"])
def test_gla_sweep_smoke_run_in_interpret_mode(op):
    """`benchmarks.gla_sweep` in Pallas interpret mode on the CPU, for both ops: a row per
    (shape, configuration), positive times, and the float32 output within 1e-5 of the xla
    backend's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gla_sweep", "--op", op, "--shapes", "tiny",
         "tiny_ragged", "--configs", "16,4,16,1", "32,4,16,2,2", "--interpret", "--dtype",
         "float32"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 4
    for row in rows:
        fwd_ms, fwd_bwd_ms, error = float(row[3]), float(row[4]), float(row[5].rstrip(" |"))
        assert fwd_ms > 0 and fwd_bwd_ms > 0 and error < 1e-5, row


@pytest.mark.smoke
def test_gla_sweep_profile_once_runs_each_program_without_timing():
    """`benchmarks.gla_sweep --profile-once` (the target given to Nsight Compute): each case's
    forward and forward+backward run, in interpret mode here, and no timed row is printed."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gla_sweep", "--op", "gated_delta", "--shapes", "tiny",
         "--configs", "16,4,16,1", "--interpret", "--profile-once"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert not [line for line in result.stdout.splitlines() if line.startswith("| tiny")]


@pytest.mark.smoke
def test_kernel_speed_checks_and_times_the_gated_delta_rule():
    """`benchmarks.kernel_speed --small --ops gated_delta` on the CPU: every backend that runs
    here is checked in float32 against the sequential reference (o and all five gradients, the
    scalar beta among them, within the script's tolerance) and timed; pallas_gpu is named as
    unavailable."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_speed", "--small", "--ops", "gated_delta",
         "--budget-s", "0.2", "--repeats", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    checks = [line for line in result.stdout.splitlines()
              if line.startswith("| tiny") and line.endswith("| yes |")]
    assert len(checks) == 3 and all("gated_delta xla" in line for line in checks)
    errors = [float(x) for x in checks[0].split(" | ")[2:-2] if x != "—"]
    assert len(errors) == 6 and max(errors) < 1e-5   # o, dq, dk, dv, dlog_alpha, dwrite_strength
    assert "gated_delta backend pallas_gpu does not run here" in result.stdout


@pytest.mark.smoke
def test_mqar_sweep_speed_times_the_bare_step_and_the_replica_programs():
    """`benchmarks.mqar_sweep_speed` on a tiny MQAR setting: a row per mixer with the bare step
    at the batch and at 4x it and the 1- and 4-replica programs timed, and each ratio the
    quotient of its two times; with --programs only those are timed, the other cells '-'."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    tiny = [sys.executable, "-m", "benchmarks.mqar_sweep_speed", "--mixers", "mamba2",
            "--seq-len", "32", "--pairs", "4", "--batch", "8", "--num-train", "64", "--steps", "2"]
    rows = []
    for extra in ([], ["--programs", "x1", "bare"]):
        result = subprocess.run(tiny + extra, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        rows += [line.strip("| ").split(" | ")[1:] for line in result.stdout.splitlines()
                 if line.startswith("| mamba2")]
    assert len(rows) == 2
    bare, bare4, bare4_ratio, one, one_ratio, four, four_ratio, four_bare4 = map(float, rows[0])
    assert min(bare, bare4, one, four) > 0
    assert bare4_ratio == pytest.approx(bare4 / bare, abs=0.01)
    assert one_ratio == pytest.approx(one / bare, abs=0.01)
    assert four_ratio == pytest.approx(four / one, abs=0.01)
    assert four_bare4 == pytest.approx(four / bare4, abs=0.01)
    bare, bare4, bare4_ratio, one, one_ratio, four, four_ratio, four_bare4 = rows[1]
    assert [bare4, bare4_ratio, four, four_ratio, four_bare4] == ["-"] * 5
    assert float(one_ratio) == pytest.approx(float(one) / float(bare), abs=0.01)


@pytest.mark.smoke
def test_mqar_determinism_compares_two_runs_and_two_compilations(tmp_path):
    """`benchmarks.mqar_determinism` on a tiny setting: the same program twice gives the same
    parameters on the CPU, and so does a second process compiling it again (compared through
    --save / --compare; without the tests' compilation cache, so it does compile again); a
    different learning rate is a nonzero difference; each process prints its step time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or "CACHE" not in k}
    env["JAX_PLATFORMS"] = "cpu"
    tiny = [sys.executable, "-m", "benchmarks.mqar_determinism", "--mixer", "mamba2", "--seq-len",
            "32", "--pairs", "4", "--batch", "8", "--num-train", "64", "--steps", "3"]
    saved = tmp_path / "a.npz"
    outputs = []
    for extra in (["--save", str(saved)], ["--compare", str(saved)],
                  ["--compare", str(saved), "--lr", "1e-2"]):
        result = subprocess.run(tiny + extra, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        outputs.append(result.stdout)
    differences = [float(line.rsplit(" ", 1)[1]) for out in outputs for line in out.splitlines()
                   if "largest parameter difference" in line]
    # run 1 twice; run 2 twice and against run 1; run 3 twice, and against lr 4.64e-3
    assert differences[:4] == [0.0, 0.0, 0.0, 0.0] and differences[4] > 1e-4
    assert len(differences) == 5
    step_ms = [float(line.rsplit(" ", 1)[1]) for out in outputs for line in out.splitlines()
               if line.startswith("second run, compiled: ms per step")]
    assert len(step_ms) == 3 and all(ms > 0 for ms in step_ms)
