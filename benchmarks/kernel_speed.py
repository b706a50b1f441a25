"""Speed, memory and agreement of the attention backends (README "Benchmarks").

Times the forward and the forward+backward (gradient of <o, w> w.r.t. every differentiable
input, under `jax.jit`) of each `palimpsa_attention` backend, per chunk size for the chunked
ones, and of each `gla_attention` backend (the non-metaplastic speed of light) and each
`gated_delta_attention` backend (Gated DeltaNet), over the reference
shapes (README "Benchmarks"). Every row is set against the authors' Triton kernel and the ceiling. Before a
shape is timed, each chunked backend is checked in float32 against the sequential reference;
the exit status is 1 if any relative error exceeds the tolerance, a case fails or a shape is
left out by --time-limit-s. Backends that cannot run on the platform (pallas_gpu on a CPU) are
named in the header and left out.

    python -m benchmarks.kernel_speed                      # reference shapes, bf16
    python -m benchmarks.kernel_speed --small              # tiny shapes, a CPU smoke run
    python -m benchmarks.kernel_speed --shapes lm_170m --chunk-sizes 16 32 64 --output RESULTS.md
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import math
import pathlib
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from palimpsa_jax import kernels

GIB = 2**30
TOLERANCE = 1e-4

# Ceiling (README "Benchmarks"): the LM shape's 8*2048*16*48*48 state-element updates take >= 0.15 ms
# forward and >= 0.5 ms forward+backward; other shapes scale with B*T*H*Dv*Dk.
LM_STATE_UPDATES = 8 * 2048 * 16 * 48 * 48
CEILING_MS = {"fwd": 0.15, "fwd+bwd": 0.5}
PASSES = tuple(CEILING_MS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """(B, T, H, Dk, Dv) and the authors' Triton figures (fwd ms, fwd+bwd ms, peak GiB)."""
    name: str
    batch: int
    length: int
    heads: int
    dk: int
    dv: int
    triton: tuple[float, float, float] | None = None

    @property
    def dims(self) -> str:
        return f"({self.batch}, {self.length}, {self.heads}, {self.dk}, {self.dv})"

    @property
    def state_updates(self) -> int:
        return self.batch * self.length * self.heads * self.dv * self.dk

    def ceiling_ms(self, pass_: str) -> float:
        return CEILING_MS[pass_] * self.state_updates / LM_STATE_UPDATES


REFERENCE_SHAPES = (
    Shape("lm_170m", 8, 2048, 16, 48, 48, (3.88, 19.26, 1.18)),
    Shape("mqar", 64, 512, 8, 16, 32, (0.94, 3.79, 0.76)),
    Shape("palimpsa_m", 8, 2048, 16, 48, 96, (7.21, 38.94, 2.08)),
    Shape("long_seq", 1, 16384, 16, 48, 48, (25.31, 104.68, 1.55)),
    Shape("wide_head", 4, 4096, 8, 128, 128, (17.91, 84.51, 3.13)),
)
SMALL_SHAPES = (
    Shape("tiny", 2, 64, 2, 8, 8),
    Shape("tiny_ragged", 2, 100, 2, 16, 32),  # T is no multiple of the chunk sizes: padding
    Shape("tiny_long", 1, 512, 2, 16, 16),
)
SHAPES = {s.name: s for s in REFERENCE_SHAPES + SMALL_SHAPES}

# op name -> (entry point, the differentiable inputs it takes)
OPS = {
    "palimpsa": (kernels.palimpsa_attention, ("q", "k", "v", "beta", "log_alpha", "prior")),
    "gla": (kernels.gla_attention, ("q", "k", "v", "log_alpha")),
    "gated_delta": (kernels.gated_delta_attention, ("q", "k", "v", "write_strength", "log_alpha")),
}
REGISTRIES = {"palimpsa": kernels.PALIMPSA_BACKENDS, "gla": kernels.GLA_BACKENDS,
              "gated_delta": kernels.GATED_DELTA_BACKENDS}
BASELINES = ("gla", "gated_delta")     # timed at each backend's own chunk size


def default_chunk_size(op: str, backend: str) -> int | None:
    """The backend's own chunk size, or None for an unchunked backend."""
    parameter = inspect.signature(REGISTRIES[op][backend]).parameters.get("chunk_size")
    return None if parameter is None else parameter.default


@dataclasses.dataclass(frozen=True)
class Variant:
    """One op, backend and chunk size."""
    op: str
    backend: str
    chunk_size: int | None = None

    @property
    def label(self) -> str:
        if self.chunk_size is None:
            return f"{self.op} {self.backend}"
        default = " (default)" if self.chunk_size == default_chunk_size(self.op, self.backend) else ""
        return f"{self.op} {self.backend} C={self.chunk_size}{default}"

    @property
    def inputs(self) -> tuple[str, ...]:
        return OPS[self.op][1]

    def __call__(self, xs: dict):
        fn, names = OPS[self.op]
        return fn(*(xs[name] for name in names), backend=self.backend,
                  chunk_size=self.chunk_size)


def unavailable_reason(op: str, backend: str) -> str | None:
    """Why a backend of `op` cannot run on this platform (tried on a tiny input), or None."""
    xs, _ = make_inputs(jax.random.key(0), Shape("probe", 1, 16, 1, 2, 2), jnp.float32)
    try:
        jax.block_until_ready(Variant(op, backend)({n: xs[n] for n in OPS[op][1]}))
    except Exception as e:  # e.g. a GPU-only backend on CPU
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def variants(op: str, backends, chunk_sizes) -> list[Variant]:
    """One variant per backend, and per chunk size for the chunked backends.

    chunk_sizes None: each chunked backend at its own default chunk size.
    """
    out = []
    for backend in backends:
        default = default_chunk_size(op, backend)
        if default is None:
            out.append(Variant(op, backend))
        else:
            out.extend(Variant(op, backend, c) for c in chunk_sizes or [default])
    return out


def make_inputs(key, shape: Shape, dtype):
    """Gates and features as a trained layer emits them, plus the loss weights w.

    q, k: unit L2 norm per head; v: standard normal; beta = softplus(normal) > 0;
    log_alpha = -A dt with A log-uniform in [1, 16] per head and dt log-uniform in [1e-3, 0.1]
    per token (Mamba2's ranges); prior = 1; write_strength = sigmoid(normal) (B, T, H), Gated
    DeltaNet's beta. q, k, v, beta in `dtype`; log_alpha, prior, write_strength, w fp32.
    """
    B, T, H, Dk, Dv = shape.batch, shape.length, shape.heads, shape.dk, shape.dv
    kq, kk, kv, kbeta, kA, kdt, kw = jax.random.split(key, 7)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    log_uniform = lambda k, s, lo, hi: jnp.exp(jax.random.uniform(k, s, minval=math.log(lo),
                                                                  maxval=math.log(hi)))
    A = log_uniform(kA, (H,), 1.0, 16.0)
    dt = log_uniform(kdt, (B, T, H), 1e-3, 1e-1)
    xs = {
        "q": unit(jax.random.normal(kq, (B, T, H, Dk))).astype(dtype),
        "k": unit(jax.random.normal(kk, (B, T, H, Dk))).astype(dtype),
        "v": jax.random.normal(kv, (B, T, H, Dv)).astype(dtype),
        "beta": jax.nn.softplus(jax.random.normal(kbeta, (B, T, H, Dv))).astype(dtype),
        "log_alpha": -A * dt,
        "prior": jnp.ones((H,), jnp.float32),
        "write_strength": jax.nn.sigmoid(jax.random.normal(jax.random.fold_in(key, 7), (B, T, H))),
    }
    return xs, jax.random.normal(kw, (B, T, H, Dv))


def program(variant: Variant, pass_: str):
    """The function timed for a pass: fwd: xs -> o; fwd+bwd: (xs, w) -> ((<o, w>, o), d<o, w>/dxs)."""
    if pass_ == "fwd":
        return variant

    def loss(xs, w):
        o = variant(xs)
        return jnp.vdot(o.astype(jnp.float32), w), o

    return jax.value_and_grad(loss, has_aux=True)


def arguments(variant: Variant, pass_: str, xs: dict, w):
    """Positional arguments of `program(variant, pass_)`."""
    xs = {name: xs[name] for name in variant.inputs}
    return (xs,) if pass_ == "fwd" else (xs, w)


def compiled_peak_bytes(compiled) -> int:
    """Arguments + outputs + temporaries - aliased bytes of a compiled executable."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def allocator_peak_bytes() -> int | None:
    """The device allocator's running peak (memory_stats), None where the device has none."""
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else stats.get("peak_bytes_in_use")


def time_ms(compiled, argument_sets, repeats: int, budget_s: float) -> list[float]:
    """Wall times in ms of `compiled`, rotating among argument sets.

    Each set runs once to warm up; the repetitions are capped so the timed calls fit `budget_s`
    (at least 3).
    """
    def call(args) -> float:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return (time.perf_counter() - start) * 1e3

    warm = min(call(args) for args in argument_sets)
    n = max(3, min(repeats, int(budget_s * 1e3 / warm)))
    return [call(argument_sets[i % len(argument_sets)]) for i in range(n)]


@dataclasses.dataclass
class Result:
    """Medians (ms), compiled peaks and allocator peak (bytes) of one (shape, variant)."""
    shape: Shape
    variant: Variant
    median_ms: dict = dataclasses.field(default_factory=dict)
    compiled_bytes: dict = dataclasses.field(default_factory=dict)
    allocator_bytes: int | None = None
    allocator_rose: bool = True
    error: str | None = None


def benchmark(shape: Shape, variant: Variant, input_sets, args) -> Result:
    """Compiles and times both passes of one variant on one shape."""
    result = Result(shape, variant)
    before = allocator_peak_bytes()
    try:
        for pass_ in PASSES:
            argument_sets = [arguments(variant, pass_, xs, w) for xs, w in input_sets]
            start = time.perf_counter()
            compiled = jax.jit(program(variant, pass_)).lower(*argument_sets[0]).compile()
            compile_s = time.perf_counter() - start
            result.compiled_bytes[pass_] = compiled_peak_bytes(compiled)
            times = time_ms(compiled, argument_sets, args.repeats, args.budget_s)
            result.median_ms[pass_] = statistics.median(times)
            print(f"  {shape.name:12s} {variant.label:30s} {pass_:8s} "
                  f"median {result.median_ms[pass_]:9.3f} ms"
                  f"  min {min(times):9.3f}  max {max(times):9.3f}  n={len(times):2d}"
                  f"  (compile {compile_s:.1f} s)", flush=True)
    except Exception as e:  # an OOM or compiler failure ends this case, not the sweep
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"  {shape.name:12s} {variant.label:30s} FAILED {result.error}", flush=True)
    result.allocator_bytes = allocator_peak_bytes()
    result.allocator_rose = before is None or result.allocator_bytes > before
    return result


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = (np.asarray(x, np.float64).ravel() for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(shape: Shape, chunked: list[Variant], reference: Variant, key) -> list[tuple]:
    """fp32 relative errors (o and every gradient) of chunked variants against the reference.

    Returns rows (shape, variant, {name: error}) at batch 1 to keep the reference cheap.
    """
    small = dataclasses.replace(shape, batch=1)
    xs, w = make_inputs(key, small, jnp.float32)
    run = lambda v: jax.jit(program(v, "fwd+bwd"))(*arguments(v, "fwd+bwd", xs, w))
    (_, o_ref), grads_ref = run(reference)
    rows = []
    for variant in chunked:
        (_, o), grads = run(variant)
        errors = {"o": relative_error(o, o_ref)}
        errors.update({f"d{name}": relative_error(grads[name], grads_ref[name]) for name in grads})
        rows.append((small, variant, errors))
        print(f"  {small.name:12s} {variant.label:30s} check "
              + "  ".join(f"{n} {e:.1e}" for n, e in errors.items()), flush=True)
    return rows


def fmt(x, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table with header `head`."""
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def timing_row(r: Result, has_allocator: bool) -> list[str]:
    """Medians, Triton figures, % of the ceiling and peaks of one (shape, variant)."""
    ms = {p: r.median_ms.get(p) for p in PASSES}
    pct = {p: None if ms[p] is None else 100 * r.shape.ceiling_ms(p) / ms[p] for p in PASSES}
    gib = {p: None if p not in r.compiled_bytes else r.compiled_bytes[p] / GIB for p in PASSES}
    triton = "—" if r.shape.triton is None else "{} / {}, {}".format(*r.shape.triton)
    row = [f"{r.shape.name} {r.shape.dims}", r.variant.label,
           fmt(ms["fwd"]), fmt(ms["fwd+bwd"]), triton,
           fmt(pct["fwd"], ".2g"), fmt(pct["fwd+bwd"], ".2g"),
           f"{fmt(gib['fwd'], '.3g')} / {fmt(gib['fwd+bwd'], '.3g')}"]
    if has_allocator:
        row.append(("" if r.allocator_rose else "≤ ") + fmt(r.allocator_bytes / GIB, ".3g"))
    if r.error:
        row[2] = f"failed: {r.error}"
    return row


def timing_table(results: list[Result], has_allocator: bool) -> str:
    """Markdown table, one row per (shape, variant)."""
    head = ["shape (B, T, H, Dk, Dv)", "kernel", "fwd ms", "fwd+bwd ms",
            "Triton fwd / fwd+bwd ms, peak GiB", "fwd % ceiling", "fwd+bwd % ceiling",
            "peak GiB fwd / fwd+bwd (compiled)"] + ["peak GiB (allocator)"] * has_allocator
    return markdown_table(head, [timing_row(r, has_allocator) for r in results])


def check_table(rows: list[tuple]) -> str:
    """Markdown table of relative errors, one row per (shape, variant)."""
    names = ["o", "dq", "dk", "dv", "dbeta", "dlog_alpha", "dprior", "dwrite_strength"]
    head = ["shape (B, T, H, Dk, Dv)", "kernel vs reference", *names, "max", "pass"]
    table = []
    for shape, variant, errors in rows:
        worst = max(errors.values())
        table.append([f"{shape.name} {shape.dims}", variant.label,
                      *(fmt(errors.get(n), ".1e") for n in names),
                      f"{worst:.1e}", "yes" if worst <= TOLERANCE else "**NO**"])
    return markdown_table(head, table)


def header(args, unavailable: dict) -> str:
    device = jax.devices()[0]
    lines = [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- device: {device.device_kind} ({device.platform}, {jax.device_count()} device(s))",
        f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {platform.python_version()}",
        (f"- inputs: q, k, v, beta {args.dtype}; log_alpha, prior, write_strength float32; "
         f"{args.input_sets} input sets in rotation"),
        (f"- timing: median of up to {args.repeats} calls after one warm-up call per input set, "
         f"capped at {args.budget_s:g} s of calls per pass (at least 3); host clock around "
         "`block_until_ready`"),
    ]
    lines += [f"- {op} backend {b} does not run here: {why}" for (op, b), why in unavailable.items()]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                       default=[s.name for s in REFERENCE_SHAPES],
                       help="shapes to run (the reference shapes by default)")
    which.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    parser.add_argument("--ops", nargs="+", choices=sorted(OPS), default=sorted(OPS),
                        help="kernels to time and check: palimpsa_attention, gla_attention, "
                             "gated_delta_attention")
    parser.add_argument("--backends", nargs="+", choices=sorted(kernels.PALIMPSA_BACKENDS),
                        help="palimpsa backends to time and check (default: all that run here)")
    parser.add_argument("--chunk-sizes", nargs="+", type=int,
                        help="chunk sizes of the chunked palimpsa backends (default: each "
                             "backend's own)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per pass, at most")
    parser.add_argument("--budget-s", type=float, default=4.0, help="seconds of timed calls per pass")
    parser.add_argument("--input-sets", type=int, default=3, help="input sets to rotate among")
    parser.add_argument("--skip-check", action="store_true", help="no fp32 check against the reference")
    parser.add_argument("--time-limit-s", type=float,
                        help="start no new shape after this many seconds (the report lists it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=pathlib.Path, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    if args.small:
        args.shapes = [s.name for s in SMALL_SHAPES]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = [SHAPES[name] for name in args.shapes]
    dtype = jnp.dtype(args.dtype)
    unavailable = {(op, b): unavailable_reason(op, b) for op in args.ops for b in REGISTRIES[op]}
    unavailable = {case: why for case, why in unavailable.items() if why}
    runs = lambda op: [b for b in REGISTRIES[op] if (op, b) not in unavailable]
    backends = args.backends or runs("palimpsa")
    # GLA (the non-metaplastic speed of light) and Gated DeltaNet: every backend but the
    # reference, at its own chunk size
    baselines = {op: variants(op, [b for b in runs(op) if b != "reference"], None)
                 for op in BASELINES if op in args.ops}
    palimpsa = "palimpsa" in args.ops
    timed = ((variants("palimpsa", backends, args.chunk_sizes) if palimpsa else [])
             + [variant for chunked in baselines.values() for variant in chunked])
    checked = (variants("palimpsa", [b for b in backends if b != "reference"], args.chunk_sizes)
               if palimpsa else [])
    key = jax.random.key(args.seed)
    start = time.perf_counter()
    setup = header(args, unavailable)
    print(setup, flush=True)

    check_rows, results, skipped = [], [], []
    for shape in shapes:
        if args.time_limit_s is not None and time.perf_counter() - start > args.time_limit_s:
            skipped.append(shape.name)
            continue
        print(f"\n{shape.name} {shape.dims}:", flush=True)
        if not args.skip_check:
            if checked:
                check_rows += check(shape, checked, Variant("palimpsa", "reference"), key)
            for op, chunked in baselines.items():
                check_rows += check(shape, chunked, Variant(op, "reference"), key)
        input_sets = [make_inputs(k, shape, dtype)
                      for k in jax.random.split(jax.random.fold_in(key, 1), args.input_sets)]
        results += [benchmark(shape, variant, input_sets, args) for variant in timed]
        del input_sets  # free this shape's inputs before drawing the next

    has_allocator = allocator_peak_bytes() is not None
    notes = [
        ("Ceiling (README 'Benchmarks'), 0.15 ms fwd / 0.5 ms fwd+bwd at the LM shape's 604M "
         "state-element updates, scaled by B·T·H·Dv·Dk; % ceiling = ceiling / measured."),
        "Triton: the authors' kernel (chunk 16) on one H200, as the README's 'Benchmarks' quotes it.",
        ("Peak (compiled): `memory_analysis()` of the jitted program, arguments + outputs + "
         "temporaries."),
    ]
    if has_allocator:
        notes.append("Peak (allocator): `device.memory_stats()['peak_bytes_in_use']` after the "
                     "case; JAX cannot reset it, so it is the process's running maximum, and '≤' "
                     "marks a case that did not raise it.")
    report = "\n\n".join(filter(None, [
        "## Setup\n\n" + setup,
        "## Timing\n\n" + timing_table(results, has_allocator) + "\n\n"
        + "\n".join(f"- {n}" for n in notes),
        check_rows and "## fp32 agreement with the reference backend (relative error, batch 1)\n\n"
        + check_table(check_rows),
        skipped and f"Not run (time limit {args.time_limit_s:g} s): {', '.join(skipped)}.",
        "## Command\n\n```\n" + shlex.join([pathlib.Path(sys.executable).name, *sys.argv]) + "\n```",
    ]))
    print("\n" + report)
    if args.output:
        args.output.write_text(report + "\n")

    failed_checks = [r for r in check_rows if max(r[2].values()) > TOLERANCE]
    failed_cases = [r for r in results if r.error]
    if failed_checks or failed_cases or skipped:
        print(f"\nFAILED: {len(failed_checks)} check(s) over {TOLERANCE:g}, "
              f"{len(failed_cases)} case(s) errored, {len(skipped)} shape(s) not run",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
