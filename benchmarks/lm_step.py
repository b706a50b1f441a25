"""Training throughput of the language models (issue 14): every LM preset's full train step side
by side, where its time goes, and flash-linear-attention (fla) beside it when fla is installed.

    python -m benchmarks.lm_step                                   # 170M presets, batch 8 x 2048
    python -m benchmarks.lm_step --profile-dir /tmp/lm_trace --out results.json
    python -m benchmarks.lm_step --parts kernels fla_model         # kernels and fla's model
    python -m benchmarks.lm_step --small                           # tiny models, a CPU smoke run

--time-limit-s starts no new model or kernel case past that many seconds (the report lists what
it left out).

Models. Each preset runs through `palimpsa_jax.training.Trainer` with the config of the LM
experiment (experiments/lm: AdamW, global-norm clipping, bf16 compute over float32 master
weights) on one batch of random token ids, placed on the device once. The step is compiled once,
then timed two ways: median of --repeats steps, each waited for (host clock around
`block_until_ready`), and "pipelined": --repeats steps dispatched back to back and waited for once
(median of 3 such runs), as the training loop runs them, where a step's dispatch overlaps the step
before. tokens/s = batch x seq_len / pipelined step (what the trainer logs); MFU = tokens/s x
training FLOPs per token / the device's peak (`palimpsa_jax.models.flops`; no MFU column where the
peak is unknown, e.g. on a CPU). Peak memory is the allocator's running maximum
(`memory_stats()['peak_bytes_in_use']`): JAX cannot reset it, so a model that did not raise it is
marked '≤'.

Profile (--profile-dir DIR). Three more steps per model under `jax.profiler.trace`; the device
events of the Perfetto trace (the GPU stream lines; on a host-only trace the events that name an
HLO instruction) are summed per op class, per step. An event is matched to its instruction in the
step's optimised HLO (by its `hlo_op`, else by its kernel name) and classed by the first rule
that holds, looking at the Python source stacks that the HLO keeps for the instruction and the
ones fused into it (backward ops keep their forward op's stack), then at opcodes and names:

  recurrent    a stack passes through palimpsa_jax.kernels (Pallas/Triton kernels, the chunked
               scans and their while bodies, the custom VJPs), or a kernel or custom-call name
               contains palimpsa, gla, delta or pallas
  attention    cuDNN / flash kernels (fmha, flash, sdpa, attention in the name), or a stack
               through layers/attention.py outside its projections (flax Linear) and RoPE
  embedding    the token lookup and its sorted-segment gradient (embedding_lookup)
  loss         token_metrics, a cross-entropy or log-softmax function, or optax's losses
  optimizer    optax (the AdamW update, clipping, the gradient norm) or training/optim.py
  matmul       a dot (alone or fused, e.g. Triton GEMM fusions), a cuBLAS custom call, or a
               kernel named gemm, cublas, cutlass, nvjet, xmma or dot
  copies       copy / transpose instructions, fusions of only those, memcpy / memset
  graph        a command buffer: XLA launches runs of kernels as one CUDA graph, whose trace
               event cannot be split into its kernels. Profile with
               XLA_FLAGS=--xla_gpu_enable_command_buffer= (every kernel its own event; the
               setup lines give XLA_FLAGS, which also apply to the timed steps)
  elementwise  the rest: norms, short convolutions, gates, residuals

host/idle = the traced step's wall time minus the union of its device intervals. Classes sum
durations, so overlapping streams can make them exceed the union. The top ops by time, and the
share of device time whose event was matched to an HLO instruction, are printed so that the
rules can be checked.

fla (only where `import fla` works and torch sees a CUDA device; it runs first, and hands its
memory back before JAX takes its pool). Kernels: fla's chunk_simple_gla and
chunk_gated_delta_rule ((B, T, H, D) layout, g the log-decay, beta after the sigmoid) at the LM
layer shape and at the Mamba2 / Gated DeltaNet layers' own shapes, forward (no grad) and forward
+ backward (torch.autograd.grad of sum(o) w.r.t. q, k, v, g and beta), bf16 with float32 g,
median of CUDA-event times after 3 warm-up calls; beside them ours (`gla_attention`,
`gated_delta_attention`, every registered backend but the sequential reference, or --backends),
jitted, forward and jax.value_and_grad of sum(o) on the same inputs, and the relative error of our o
against fla's. Model: fla's GatedDeltaNetForCausalLM at our gated_deltanet preset's sizes (same
layers, heads, head and MLP widths, short convolutions, output gate, tied embeddings, vocabulary;
fla's fused norm, SwiGLU and cross-entropy), torch AdamW (fused) with the same hyperparameters and
clipping, (a) float32 weights under bf16 autocast, our trainer's precision, and (b) bf16 weights.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import gzip
import importlib
import json
import math
import os
import pathlib
import platform
import re
import shlex
import statistics
import sys
import time

import flax.nnx.nn.linear
import jax
import jax.numpy as jnp
import numpy as np
import optax

import palimpsa_jax.layers.attention
import palimpsa_jax.training.optim
from benchmarks.kernel_speed import GIB, allocator_peak_bytes, fmt, markdown_table, relative_error
from benchmarks.mqar_step_profile import median_ms
from palimpsa_jax import kernels, sharding
from palimpsa_jax.experiments.lm import palimpsa_d as lm_experiment
from palimpsa_jax.models import count_params, flops, preset
from palimpsa_jax.training import Trainer, environment, model_fields

MODELS = ("palimpsa_d", "gated_deltanet", "mamba2", "transformer")
SIZES = ("170m", "340m", "760m")
PARTS = ("models", "kernels", "fla_model")
SMALL = dict(vocab_size=256, d_model=64, n_layers=1, num_heads=2, head_dim=16, ssm_state=16,
             ssm_head_dim=16)
PROFILED_STEPS = 3

# --- models -----------------------------------------------------------------------------------


def failure(e: Exception) -> str:
    """An exception in one line, for a table cell."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def model_config(model: str, args):
    """The preset `<model>-<size>` in bf16 (--small: one layer of width 64, vocabulary 256)."""
    config = preset(f"{model}-{args.preset_size}", dtype="bfloat16", backend=args.model_backend)
    if args.small:
        config = config.replace(**SMALL, mlp_hidden=128 if config.mlp_hidden else 0)
    return config


def model_name(model: str, args) -> str:
    return f"{model}-{'small' if args.small else args.preset_size}"


def lm_config(model: str, args):
    """The LM experiment's config with the model, batch and sequence length of this run."""
    c = lm_experiment.get_config(args.preset_size)
    c.model = model_fields(model_config(model, args))
    c.batch_size, c.data.seq_len = args.batch, args.seq_len
    c.data.path = "unused"   # the step is fed one batch directly; nothing is read
    return c


def token_batch(args) -> dict[str, np.ndarray]:
    """Random ids (B, T) as tokens and labels; --documents > 1 packs that many equal documents a
    row, with segment ids, as the text pipeline does."""
    vocab = model_config(MODELS[0], args).vocab_size
    tokens = np.random.default_rng(args.seed).integers(0, vocab, (args.batch, args.seq_len),
                                                       dtype=np.int32)
    batch = {"tokens": tokens, "labels": np.roll(tokens, -1, axis=1)}
    if args.documents > 1:
        ids = 1 + np.arange(args.seq_len) * args.documents // args.seq_len
        batch["segment_ids"] = np.broadcast_to(ids, tokens.shape).astype(np.int32)
    return batch


def run_model(model: str, args) -> dict:
    """Times one preset's train step (and profiles it, with --profile-dir)."""
    config = lm_config(model, args)
    trainer = Trainer(config)
    row = {"model": model_name(model, args), "params": count_params(trainer.model_config)}
    before = allocator_peak_bytes()
    with sharding.use_mesh(trainer.mesh, trainer.rules):
        holder = {"state": trainer.init_state()}
        batch = trainer.global_batch(token_batch(args))
        start = time.perf_counter()
        compiled = trainer.train_step.lower(holder["state"], batch).compile()
        row["compile_s"] = time.perf_counter() - start

        def step():
            holder["state"], metrics = compiled(holder["state"], batch)
            return holder["state"], metrics

        row["ms_per_step"] = median_ms(step, args.repeats)
        row["ms_per_step_pipelined"] = pipelined_ms(step, args.repeats)
        row["loss"] = float(step()[1]["loss"])
        if args.profile_dir:
            trace_dir = args.profile_dir / row["model"]
            with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                start = time.perf_counter()
                for _ in range(PROFILED_STEPS):
                    jax.block_until_ready(step())
                wall_ms = 1e3 * (time.perf_counter() - start) / PROFILED_STEPS
            row["profile"] = breakdown(trace_dir, Hlo(compiled.as_text()), wall_ms)
    row["tokens_per_s"] = args.batch * args.seq_len / (row["ms_per_step_pipelined"] / 1e3)
    row["mfu"] = mfu(trainer.model_config, args.seq_len, row["tokens_per_s"])
    row["peak_bytes"] = allocator_peak_bytes()
    row["peak_rose"] = before is None or row["peak_bytes"] > before
    return row


def pipelined_ms(step, steps: int, rounds: int = 3) -> float:
    """ms per step of `steps` steps dispatched back to back and waited for once, as the training
    loop runs them (the host queues a step while the device runs the one before); median of
    `rounds` such runs."""
    jax.block_until_ready(step())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps - 1):
            step()
        jax.block_until_ready(step())
        times.append((time.perf_counter() - start) / steps)
    return 1e3 * statistics.median(times)


def mfu(model_config, seq_len: int, tokens_per_s: float) -> float | None:
    """Model FLOP utilisation of one device (`models.flops`), None where its peak is unknown."""
    peak = flops.peak_flops(jax.devices()[0].device_kind)
    if peak is None:
        return None
    return flops.mfu(tokens_per_s, flops.train_flops_per_token(model_config, seq_len), peak)


# --- profile: the optimised HLO and the trace --------------------------------------------------

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.*?\s(?P<op>[a-z][\w\-]*)\(")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*->.*\{\s*$")
TABLE_ROW = re.compile(r"^(\d+) (.*)$")
CONTROL_FLOW = {"while", "conditional", "call", "async-start", "async-done"}
COPY_OPS = {"copy", "transpose", "copy-start", "copy-done"}
LAYOUT_OPS = COPY_OPS | {"fusion", "parameter", "bitcast", "reshape", "tuple", "get-tuple-element"}


def _attribute(pattern: str, line: str) -> str | None:
    match = re.search(pattern, line)
    return match and match.group(1)


@dataclasses.dataclass
class Instruction:
    opcode: str
    calls: str | None
    target: str | None
    frame: int | None


class Hlo:
    """The instructions of an optimised HLO module's text, with their Python source stacks."""

    def __init__(self, text: str):
        self.module = re.match(r"HloModule (\S+?),?\s", text).group(1)
        self.instructions: dict[str, Instruction] = {}
        self.computations = collections.defaultdict(list)
        tables, table, computation = collections.defaultdict(dict), None, None
        for line in text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = line
            elif table and (row := TABLE_ROW.match(line)):
                tables[table][int(row.group(1))] = row.group(2)
            elif match := COMPUTATION.match(line):
                table, computation = None, match["name"]
            elif match := INSTRUCTION.match(line):
                frame = _attribute(r"stack_frame_id=(\d+)", line)
                self.instructions[match["name"]] = Instruction(
                    match["op"], _attribute(r"calls=%?([\w.\-]+)", line),
                    _attribute(r'custom_call_target="([^"]+)"', line), frame and int(frame))
                self.computations[computation].append(match["name"])
        self.kernel_names = {re.sub(r"[.\-]", "_", n): n for n in self.instructions}
        numbers = lambda s: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", s)}
        files = {i: os.path.realpath(s.strip('"')) for i, s in tables["FileNames"].items()}
        functions = {i: s.strip('"') for i, s in tables["FunctionNames"].items()}
        locations = {i: numbers(s) for i, s in tables["FileLocations"].items()}
        self.frames = {}   # id -> (file, function, caller id); the text prints caller id + 1
        for i, s in tables["StackFrames"].items():
            frame = numbers(s)
            location = locations.get(frame.get("file_location_id"), {})
            caller = frame.get("parent_frame_id", 0) - 1
            self.frames[i] = (files.get(location.get("file_name_id"), ""),
                               functions.get(location.get("function_name_id"), ""),
                               caller if 0 < caller < i else None)

    def lookup(self, hlo_op: str | None, kernel: str) -> str | None:
        """The instruction an event ran: its hlo_op, else the instruction its kernel is named after."""
        if hlo_op in self.instructions and self.instructions[hlo_op].opcode not in CONTROL_FLOW:
            return hlo_op
        return self.kernel_names.get(re.sub(r"[.\-]", "_", kernel), hlo_op)

    def stack(self, frame: int | None) -> list[tuple[str, str]]:
        """(file, function) of a stack frame and its callers."""
        out = []
        while frame in self.frames:
            file, function, frame = self.frames[frame]
            out.append((file, function))
        return out

    def features(self, name: str) -> tuple[set, set, set]:
        """Opcodes, custom-call targets and source stacks (tuples of (file, function)) of an
        instruction and of the instructions fused into it."""
        opcodes, targets, stacks, todo = set(), set(), set(), [name]
        while todo:
            inst = self.instructions[todo.pop()]
            opcodes.add(inst.opcode)
            targets.add(inst.target or "")
            stacks.add(tuple(self.stack(inst.frame)))
            if inst.opcode in ("fusion", "custom-call") and inst.calls:
                todo.extend(self.computations.get(inst.calls, []))
        return opcodes, targets, stacks


def _path(module) -> str:
    return str(pathlib.Path(module.__file__).resolve())


KERNELS_DIR = str(pathlib.Path(kernels.__file__).resolve().parent)
ATTENTION_FILE = _path(palimpsa_jax.layers.attention)
FLAX_LINEAR_FILE = _path(flax.nnx.nn.linear)
OPTAX_DIR = str(pathlib.Path(optax.__file__).resolve().parent)
OPTIM_FILE = _path(palimpsa_jax.training.optim)
DERIVED_LINES = r"XLA Modules|XLA Ops|Steps|Framework|Source|TensorFlow|Launch"
EMBEDDING_FUNCTIONS = {"embedding_lookup", "_lookup_fwd", "_lookup_bwd"}
LOSS_FUNCTIONS = r"token_metrics|cross_entropy|log_softmax|logsumexp"
NAMES = {"recurrent": r"palimpsa|gla|delta|pallas", "attention": r"fmha|flash|sdpa|attention",
         "matmul": r"gemm|cublas|cutlass|nvjet|xmma|dot", "copies": r"copy|transpose|memcpy|memset"}
CLASSES = {"matmul": "matmuls", "attention": "attention", "recurrent": "recurrent kernels",
           "embedding": "embedding lookup", "loss": "loss", "optimizer": "optimizer",
           "elementwise": "norms/convs/elementwise", "copies": "copies/transposes",
           "graph": "CUDA graphs (unsplit)"}


def attention_core(stack: tuple) -> bool:
    """Through the attention layer, outside its projections (flax Linear) and RoPE."""
    files, functions = {file for file, _ in stack}, {function for _, function in stack}
    return ATTENTION_FILE in files and FLAX_LINEAR_FILE not in files and "rope" not in functions


def classify(hlo: Hlo, name: str | None, kernel: str) -> str:
    """The op class of a device event (rules in the module docstring)."""
    if (name or "").startswith("command_buffer"):
        return "graph"
    opcodes, targets, stacks = hlo.features(name) if name in hlo.instructions else (set(), set(), set())
    names = " ".join([kernel, name or "", *targets]).lower()
    files = {file for stack in stacks for file, _ in stack}
    functions = {function for stack in stacks for _, function in stack}
    under = lambda directory: any(file.startswith(directory + os.sep) for file in files)
    if under(KERNELS_DIR) or re.search(NAMES["recurrent"], names):
        return "recurrent"
    if re.search(NAMES["attention"], names) or any(map(attention_core, stacks)):
        return "attention"
    if functions & EMBEDDING_FUNCTIONS:
        return "embedding"
    if any(re.search(LOSS_FUNCTIONS, f) for f in functions) or under(OPTAX_DIR + "/losses"):
        return "loss"
    if under(OPTAX_DIR) or OPTIM_FILE in files:
        return "optimizer"
    if "dot" in opcodes or re.search(NAMES["matmul"], names):
        return "matmul"
    layout_only = bool(opcodes & COPY_OPS) and opcodes <= LAYOUT_OPS
    if layout_only or not opcodes and re.search(NAMES["copies"], names):
        return "copies"
    return "elementwise"


def device_events(trace_dir: pathlib.Path, module: str) -> tuple[list[dict], bool]:
    """The complete events of `module` on the device lines of the newest trace under trace_dir
    (the GPU streams; without stream lines, every line of a device process but the derived
    ones: XLA Modules, XLA Ops, Steps, ...), and True; on a host-only trace, the events that name
    an HLO instruction, and False."""
    path = sorted(trace_dir.rglob("perfetto_trace.json.gz"))[-1]
    events = json.loads(gzip.open(path).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                          if e.get("ph") == "M" and e.get("name") == kind}
    devices = {pid for (pid, _), name in names("process_name").items() if "/device:" in name}
    lines = {key: name for key, name in names("thread_name").items() if key[0] in devices}
    streams = {key for key, name in lines.items() if "stream" in name.lower()} or {
        key for key, name in lines.items() if not re.search(DERIVED_LINES, name)}
    if streams:
        keep = lambda e: (e["pid"], e.get("tid")) in streams
    elif devices:
        keep = lambda e: e["pid"] in devices
    else:
        keep = lambda e: "hlo_op" in e.get("args", {})
    return [e for e in events if e.get("ph") == "X" and keep(e)
            and module in e.get("args", {}).get("hlo_module", module)], bool(devices)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def breakdown(trace_dir: pathlib.Path, hlo: Hlo, wall_ms: float, top: int = 15) -> dict:
    """ms per step by op class, host/idle, and the `top` ops by time, from a trace of
    PROFILED_STEPS steps of `hlo`'s module."""
    per_class, per_op, intervals = collections.Counter(), collections.Counter(), []
    op_class, op_kernel, matched_ms = {}, {}, 0.0
    events, on_device = device_events(trace_dir, hlo.module)
    for e in events:
        name = hlo.lookup(e.get("args", {}).get("hlo_op"), e["name"])
        if not on_device and name in hlo.instructions and hlo.instructions[name].opcode in CONTROL_FLOW:
            continue   # a loop or call on the host: the events of its body count themselves
        key = name or e["name"]
        if key not in op_class:
            op_class[key], op_kernel[key] = classify(hlo, name, e["name"]), e["name"]
        ms = e.get("dur", 0) / 1e3 / PROFILED_STEPS
        per_class[op_class[key]] += ms
        per_op[key] += ms
        matched_ms += ms if name in hlo.instructions else 0.0
        intervals.append((e["ts"], e["ts"] + e.get("dur", 0)))
    busy_ms = union_us(intervals) / 1e3 / PROFILED_STEPS
    return {"step_ms": wall_ms, "device_busy_ms": busy_ms,
            "matched_fraction": matched_ms / max(sum(per_class.values()), 1e-9),
            "stack_frames": len(hlo.frames),
            "classes_ms": {c: per_class.get(c, 0.0) for c in CLASSES},
            "host_idle_ms": max(0.0, wall_ms - busy_ms),
            "top_ops": [{"op": k, "class": op_class[k], "kernel": op_kernel[k], "ms": ms}
                        for k, ms in per_op.most_common(top)]}


# --- kernels: ours and fla's -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One op at one (B, T, H, Dk, Dv)."""
    op: str          # "gla" or "gated_delta"
    layer: str
    dims: tuple[int, int, int, int, int]

    @property
    def label(self) -> str:
        return f"{self.layer} {self.dims}"


OURS = {"gla": (kernels.gla_attention, kernels.GLA_BACKENDS, ("q", "k", "v", "log_alpha")),
        "gated_delta": (kernels.gated_delta_attention, kernels.GATED_DELTA_BACKENDS,
                        ("q", "k", "v", "beta", "log_alpha"))}
FLA_NAMES = {"gla": "fla chunk_simple_gla", "gated_delta": "fla chunk_gated_delta_rule"}


KERNEL_LAYERS = {"lm": "LM layer", "mamba2": "Mamba2 layer", "gated_deltanet": "Gated DeltaNet layer"}


def kernel_cases(args) -> list[KernelCase]:
    """The --ops at the --kernel-layers' shapes: both ops at the LM (Palimpsa-D) layer's, gla at
    Mamba2's, gated_delta at Gated DeltaNet's, each from its preset (--small: the LM layer only)."""
    pd, m2, gdn = (model_config(m, args) for m in ("palimpsa_d", "mamba2", "gated_deltanet"))
    bt = (args.batch, args.seq_len)
    lm = (*bt, pd.num_heads, pd.head_dim, pd.expand_v * pd.head_dim)
    cases = [KernelCase("gla", KERNEL_LAYERS["lm"], lm),
             KernelCase("gated_delta", KERNEL_LAYERS["lm"], lm)]
    if not args.small:
        cases += [
            KernelCase("gla", KERNEL_LAYERS["mamba2"],
                       (*bt, m2.ssm_expand * m2.d_model // m2.ssm_head_dim, m2.ssm_state,
                        m2.ssm_head_dim)),
            KernelCase("gated_delta", KERNEL_LAYERS["gated_deltanet"],
                       (*bt, gdn.num_heads, gdn.head_dim, gdn.expand_v * gdn.head_dim))]
    layers = {KERNEL_LAYERS[name] for name in args.kernel_layers}
    return [case for case in cases if case.op in args.ops and case.layer in layers]


def kernel_inputs(case: KernelCase, seed: int) -> dict[str, np.ndarray]:
    """float32 numpy inputs as a trained layer emits them: q, k of unit norm per head, v
    standard normal, beta = sigmoid(normal) (B, T, H), log_alpha = -A dt with A log-uniform in
    [1, 16] per head and dt in [1e-3, 0.1] per token."""
    B, T, H, Dk, Dv = case.dims
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    log_uniform = lambda lo, hi, *shape: np.exp(
        rng.uniform(math.log(lo), math.log(hi), shape)).astype(np.float32)
    return {"q": unit(normal(B, T, H, Dk)), "k": unit(normal(B, T, H, Dk)), "v": normal(B, T, H, Dv),
            "beta": 1 / (1 + np.exp(-normal(B, T, H))),
            "log_alpha": -log_uniform(1, 16, H) * log_uniform(1e-3, 0.1, B, T, H)}


def time_ours(case: KernelCase, backend: str, xs: dict, repeats: int) -> dict:
    """Median ms of our op's forward and of jax.value_and_grad of sum(o) (the forward and the
    backward: with jax.grad alone XLA would drop the forward of a backend that recomputes in its
    backward), jitted, and o of the first sequence."""
    fn, _, names = OURS[case.op]
    dtypes = {"log_alpha": jnp.float32}
    args = [jnp.asarray(xs[n], dtypes.get(n, jnp.bfloat16)) for n in names]
    forward = jax.jit(lambda *a: fn(*a, backend=backend))
    backward = jax.jit(jax.value_and_grad(lambda *a: forward(*a).astype(jnp.float32).sum(),
                                          argnums=tuple(range(len(args)))))
    return {"fwd_ms": median_ms(lambda: forward(*args), repeats),
            "fwd_bwd_ms": median_ms(lambda: backward(*args), repeats),
            "o": np.asarray(forward(*args)[0], np.float32)}


def cuda_median_ms(fn, repeats: int, warmup: int = 3) -> float:
    """Median CUDA-event time in ms of fn() after `warmup` calls (the first autotunes fla's
    Triton kernels)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_fla(case: KernelCase, xs: dict, repeats: int) -> dict:
    """Median ms of fla's kernel forward (no grad) and forward + backward, and o of the first
    sequence."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla
    dtypes = {"log_alpha": torch.float32}
    t = {n: torch.from_numpy(x).to("cuda", dtypes.get(n, torch.bfloat16)) for n, x in xs.items()}
    if case.op == "gla":
        inputs = [t["q"], t["k"], t["v"], t["log_alpha"]]
        fn = lambda *a: chunk_simple_gla(*a)[0]
    else:
        inputs = [t["q"], t["k"], t["v"], t["log_alpha"], t["beta"]]
        fn = lambda *a: chunk_gated_delta_rule(*a)[0]
    with torch.no_grad():
        fwd_ms = cuda_median_ms(lambda: fn(*inputs), repeats)
        o = fn(*inputs)[0].float().cpu().numpy()
    leaves = [x.requires_grad_() for x in inputs]
    fwd_bwd_ms = cuda_median_ms(lambda: torch.autograd.grad(fn(*leaves).float().sum(), leaves),
                                repeats)
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "o": o}


def run_kernels(args, fla_rows: dict, budget) -> list[dict]:
    """Our backends at every kernel case, beside fla's row of the same case (if any)."""
    rows = []
    for case in kernel_cases(args):
        if budget.spent(f"kernels {case.op} {case.label}"):
            continue
        xs = kernel_inputs(case, args.seed)
        fla = fla_rows.get(case)
        if fla:
            rows.append({"op": case.op, "shape": case.label, "implementation": FLA_NAMES[case.op],
                         **{k: v for k, v in fla.items() if k != "o"}})
        registry = OURS[case.op][1]
        for backend in args.backends or [b for b in registry if b != "reference"]:
            row = {"op": case.op, "shape": case.label, "implementation": f"ours {backend}"}
            if backend not in registry:
                row["error"] = "not registered"
            else:
                try:
                    ours = time_ours(case, backend, xs, args.repeats)
                    row.update(fwd_ms=ours["fwd_ms"], fwd_bwd_ms=ours["fwd_bwd_ms"])
                    if fla and "o" in fla:
                        row["rel_err_vs_fla"] = relative_error(ours["o"], fla["o"])
                except Exception as e:  # e.g. a GPU-only backend on CPU
                    row["error"] = failure(e)
            print(f"  {case.op:12s} {case.label:44s} {row['implementation']:28s} "
                  f"{fmt(row.get('fwd_ms'))} / {fmt(row.get('fwd_bwd_ms'))} ms "
                  f"{row.get('error', '')}", flush=True)
            rows.append(row)
    return rows


def run_fla_kernels(args, budget) -> dict:
    """fla's rows per kernel case (failures recorded, not raised)."""
    rows = {}
    for case in kernel_cases(args):
        if budget.spent(f"fla {case.op} {case.label}"):
            continue
        try:
            rows[case] = time_fla(case, kernel_inputs(case, args.seed), args.repeats)
        except Exception as e:
            rows[case] = {"error": failure(e)}
        print(f"  {FLA_NAMES[case.op]:28s} {case.label:44s} {fmt(rows[case].get('fwd_ms'))} / "
              f"{fmt(rows[case].get('fwd_bwd_ms'))} ms {rows[case].get('error', '')}", flush=True)
    return rows


def fla_model_rows(args) -> list[dict]:
    """fla's GatedDeltaNetForCausalLM at our gated_deltanet preset's sizes: median CUDA-event ms
    of one AdamW step, in both precisions."""
    import torch
    from fla.models import GatedDeltaNetConfig
    m = model_config("gated_deltanet", args)
    config = GatedDeltaNetConfig(
        hidden_size=m.d_model, num_hidden_layers=m.n_layers, num_heads=m.num_heads,
        head_dim=m.head_dim, expand_v=m.expand_v, intermediate_size=m.mlp_hidden,
        conv_size=m.conv_size, norm_eps=m.norm_eps, vocab_size=m.vocab_size,
        tie_word_embeddings=m.tie_embeddings, use_gate=True, use_short_conv=True,
        attn_mode="chunk", use_cache=False)
    tokens = torch.from_numpy(token_batch(args)["tokens"]).to("cuda", torch.long)
    rows = []
    for precision in ("float32 weights, bf16 autocast", "bf16 weights"):
        row = {"model": f"fla GatedDeltaNet ({precision})"}
        try:
            row.update(fla_model_row(config, precision, tokens, args))
        except Exception as e:
            row["error"] = failure(e)
        torch.cuda.empty_cache()
        print(f"  {row['model']:44s} {fmt(row.get('ms_per_step'), '.1f')} ms "
              f"{row.get('error', '')}", flush=True)
        rows.append(row)
    return rows


def fla_model_row(config, precision: str, tokens, args) -> dict:
    """One precision of `fla_model_rows`: AdamW (fused) with the LM experiment's settings."""
    import torch
    from fla.models import GatedDeltaNetForCausalLM
    optim = lm_config("gated_deltanet", args).optim
    torch.manual_seed(args.seed)
    model = GatedDeltaNetForCausalLM(config).to("cuda")
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.b1, optim.b2),
                            eps=optim.eps, weight_decay=optim.weight_decay, fused=True)

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled="autocast" in precision):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.cuda.reset_peak_memory_stats()
    ms = cuda_median_ms(step, args.repeats)
    return {"ms_per_step": ms, "loss": float(step()),
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": tokens.numel() / (ms / 1e3),
            "peak_bytes": torch.cuda.max_memory_allocated()}


def fla_unavailable() -> str | None:
    """Why fla's side cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        for module in ("fla.models", "fla.ops.gated_delta_rule", "fla.ops.simple_gla"):
            importlib.import_module(module)
    except Exception as e:
        return f"`import fla` failed: {failure(e)}"
    _allow_fla_gated_backward()
    return None


def _allow_fla_gated_backward() -> None:
    """fla 0.6.0 refuses its gated backward (chunk_bwd_dqkwg) on Hopper with Triton 3.4-3.7.0,
    whose code for it it reports as wrong (fla issue #640). Timing does not depend on the values,
    so the benchmark lifts the guard; fla's gradients are not compared with ours."""
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True


# --- report ------------------------------------------------------------------------------------


class Budget:
    """Starts no new case after --time-limit-s; remembers what it skipped."""

    def __init__(self, limit_s: float | None):
        self.limit_s, self.start, self.skipped = limit_s, time.perf_counter(), []

    def spent(self, what: str) -> bool:
        if self.limit_s is not None and time.perf_counter() - self.start > self.limit_s:
            self.skipped.append(what)
            return True
        return False


def versions() -> dict[str, str]:
    names = ("jax", "jaxlib", "flax", "optax", "torch", "triton", "transformers",
             "flash-linear-attention", "fla-core")
    return {"python": platform.python_version(), **environment.versions(names)}


def setup_lines(args, fla_reason: str | None) -> list[str]:
    device = jax.devices()[0]
    shape = "tiny models (--small)" if args.small else f"{args.preset_size} presets"
    return [
        f"date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"device: {device.device_kind} ({device.platform}, {jax.device_count()} device(s))",
        "software: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        (f"models: {shape}, batch {args.batch} x {args.seq_len} tokens"
         f"{f', {args.documents} documents a row (segment ids)' if args.documents > 1 else ''}, "
         f"bf16 compute over float32 master weights, model backend {args.model_backend}; "
         f"median of {args.repeats} steps after one compile"),
        "fla: " + (f"skipped ({fla_reason})" if fla_reason else "run in the same process, first"),
        f"XLA_FLAGS: {os.environ.get('XLA_FLAGS') or '(unset)'}",
    ]


def models_table(rows: list[dict]) -> str:
    has_mfu = any(r.get("mfu") is not None for r in rows)
    head = ["model", "params (M)", "ms / step (each waited)", "ms / step (pipelined)", "tokens / s",
            *["MFU"] * has_mfu, "peak GiB", "compile s", "loss"]
    table = []
    for r in rows:
        peak = r.get("peak_bytes")
        peak = "—" if peak is None else ("" if r.get("peak_rose", True) else "≤ ") + fmt(peak / GIB, ".1f")
        mfu_cell = [fmt(r.get("mfu") and 100 * r["mfu"], ".1f") + "%" * (r.get("mfu") is not None)]
        table.append([r["model"], fmt(r.get("params") and r["params"] / 1e6, ".1f"),
                      r.get("error") or fmt(r.get("ms_per_step"), ".1f"),
                      fmt(r.get("ms_per_step_pipelined"), ".1f"),
                      fmt(r.get("tokens_per_s"), ",.0f"), *mfu_cell * has_mfu, peak,
                      fmt(r.get("compile_s"), ".0f"), fmt(r.get("loss"), ".3f")])
    return markdown_table(head, table)


def breakdown_table(rows: list[dict]) -> str:
    head = ["model", "step ms (traced)", *CLASSES.values(), "host/idle", "device time matched to HLO"]
    table = []
    for r in rows:
        p = r["profile"]
        cells = [f"{ms:.1f} ({100 * ms / p['step_ms']:.0f}%)"
                 for ms in (*p["classes_ms"].values(), p["host_idle_ms"])]
        table.append([r["model"], f"{p['step_ms']:.1f}", *cells, f"{100 * p['matched_fraction']:.0f}%"])
    return markdown_table(head, table)


def top_ops_table(row: dict) -> str:
    return markdown_table(["ms / step", "class", "HLO op", "kernel"],
                          [[f"{o['ms']:.2f}", o["class"], o["op"][:60], o["kernel"][:80]]
                           for o in row["profile"]["top_ops"]])


def kernels_table(rows: list[dict]) -> str:
    head = ["op", "shape (B, T, H, Dk, Dv)", "implementation", "fwd ms", "fwd+bwd ms",
            "o rel. err. vs fla"]
    return markdown_table(head, [[r["op"], r["shape"], r["implementation"],
                                  r.get("error") or fmt(r.get("fwd_ms")), fmt(r.get("fwd_bwd_ms")),
                                  fmt(r.get("rel_err_vs_fla"), ".1e")] for r in rows])


def report(setup: list[str], results: dict, args, command: list[str]) -> str:
    models = results["models"] + results["fla_models"]
    profiled = [r for r in results["models"] if "profile" in r]
    sections = ["## Setup\n\n" + "\n".join(f"- {line}" for line in setup)]
    if models:
        sections.append(f"## Train step (median of {args.repeats} steps)\n\n" + models_table(models))
    if profiled:
        sections.append(f"## Where a step goes (ms per step, % of the traced step; {PROFILED_STEPS} "
                        "profiled steps)\n\n" + breakdown_table(profiled))
        if not all(r["profile"]["stack_frames"] for r in profiled):
            sections.append("The HLO text of some step has no stack frames: those events are "
                            "classed by opcode and kernel name alone.")
        sections += [f"### Top ops: {r['model']}\n\n" + top_ops_table(r) for r in profiled]
    if results["kernels"]:
        sections.append(f"## Kernels (bf16, median of {args.repeats} calls; ours: host clock, "
                        "fla: CUDA events)\n\n"
                        + kernels_table(results["kernels"]))
    if results["skipped"]:
        sections.append(f"Not run (time limit {args.time_limit_s:g} s): "
                        + ", ".join(results["skipped"]) + ".")
    sections.append("## Command\n\n```\n" + shlex.join(["python", "-m", "benchmarks.lm_step",
                                                         *command]) + "\n```")
    return "\n\n".join(sections)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--preset-size", choices=SIZES, default="170m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=1,
                        help="documents packed into each row, with segment ids (1: none)")
    parser.add_argument("--model-backend", default="auto", help="kernel backend of the models")
    parser.add_argument("--backends", nargs="+",
                        help="our kernel backends beside fla's (default: all registered but "
                             "reference)")
    parser.add_argument("--ops", nargs="+", choices=sorted(OURS), default=sorted(OURS),
                        help="kernel ops of the kernels part")
    parser.add_argument("--kernel-layers", nargs="+", choices=sorted(KERNEL_LAYERS),
                        default=sorted(KERNEL_LAYERS), help="layer shapes of the kernels part")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["models", "kernels"],
                        help="fla_model is opt-in: its first steps autotune fla's Triton kernels "
                             "(on one H200 it had not finished when a 9-minute call ended)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps / calls")
    parser.add_argument("--profile-dir", type=pathlib.Path,
                        help="trace 3 steps per model here and print where the time goes")
    parser.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    parser.add_argument("--output", type=pathlib.Path, help="also write the Markdown report here")
    parser.add_argument("--time-limit-s", type=float,
                        help="start no new model or kernel case after this many seconds")
    parser.add_argument("--small", action="store_true",
                        help="tiny models, batch 2 x 64, 2 repeats: a CPU smoke run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.small:
        args.batch, args.seq_len, args.repeats = 2, 64, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.time_limit_s)
    fla_reason = fla_unavailable()
    results = {"models": [], "fla_models": [], "kernels": [], "skipped": budget.skipped}
    fla_kernel_rows = {}
    if not fla_reason:   # torch first, so that JAX's memory pool does not starve it
        import torch
        if "kernels" in args.parts:
            print("fla kernels:", flush=True)
            fla_kernel_rows = run_fla_kernels(args, budget)
        if "fla_model" in args.parts:
            print("fla model:", flush=True)
            results["fla_models"] = fla_model_rows(args)
        torch.cuda.empty_cache()
    setup = setup_lines(args, fla_reason)
    print("\n".join(setup), flush=True)
    if jax.default_backend() == "cpu" and not args.small:
        print("JAX found no accelerator: the full-size run needs one (--small runs on a CPU)",
              file=sys.stderr)
        return 1
    for row in results["fla_models"]:   # the model FLOPs of our gated_deltanet preset
        if "tokens_per_s" in row:
            row["mfu"] = mfu(model_config("gated_deltanet", args), args.seq_len, row["tokens_per_s"])
    if "models" in args.parts:
        for model in args.models:
            if budget.spent(model):
                continue
            try:
                row = run_model(model, args)
            except Exception as e:  # e.g. out of memory: the other models still run
                row = {"model": model_name(model, args), "error": failure(e)}
            print(f"  {row['model']:24s} {fmt(row.get('ms_per_step'), '9.2f')} ms/step "
                  f"{fmt(row.get('tokens_per_s'), '12,.0f')} tokens/s "
                  f"(compile {fmt(row.get('compile_s'), '.0f')} s) {row.get('error', '')}", flush=True)
            results["models"].append(row)
            gc.collect()
    if "kernels" in args.parts:
        print("kernels:", flush=True)
        results["kernels"] = run_kernels(args, fla_kernel_rows, budget)
    results["setup"] = setup
    text = report(setup, results, args, sys.argv[1:] if argv is None else argv)
    print("\n" + text)
    if args.output:
        args.output.write_text(text + "\n")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
