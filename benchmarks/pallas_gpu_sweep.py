"""Tuning sweep of the Pallas GPU kernels: tile rows x warps (forward, backward) per shape.

Checks every configuration in float32 against the xla backend (forward and all gradients) on a
small shape, then times forward and forward+backward on the chosen reference shapes, within a time
limit. Prints a Markdown table last.

    python -m benchmarks.pallas_gpu_sweep --shapes lm_170m long_seq --configs 8,2,8,4,16
    python -m benchmarks.pallas_gpu_sweep --design parallel --configs 16,4,16,4,32
    ncu --kernel-name regex:palimpsa --launch-count 2 python -m benchmarks.pallas_gpu_sweep \
        --profile-once --shapes lm_170m --configs 8,2,8,4,16      # a target for Nsight Compute

A configuration is block_v,num_warps (forward), backward_block_v,backward_num_warps (backward),
the chunk size C and, optionally, the time splits of the forward and of the backward (0 or
absent: picked from the program count).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import kernel_speed as bench
from palimpsa_jax import kernels
from palimpsa_jax.kernels import chunking
from palimpsa_jax.kernels.palimpsa import pallas_gpu, pallas_gpu_parallel


def attention(xs, block_v: int, num_warps: int, backward_block_v: int, backward_num_warps: int,
              chunk_size: int, time_splits: int = 0, backward_time_splits: int = 0, *,
              design: str = "recurrent", precision: str | None = None):
    """palimpsa_attention through the pallas_gpu backend with explicit tuning options (time
    splits: the recurrent design only; precision: the parallel design only)."""
    B, T, H, Dk = xs["q"].shape
    Dv = xs["v"].shape[-1]
    zeros = jnp.zeros((B, H, Dv, Dk), jnp.float32)
    prior = jnp.broadcast_to(xs["prior"][:, None, None], (H, Dv, Dk))
    reset, log_alpha = chunking.resets(None, xs["log_alpha"])
    o, _, _, _ = pallas_gpu.palimpsa_pallas_gpu(
        xs["q"], xs["k"], xs["v"], xs["beta"], log_alpha, prior, zeros, zeros,
        reset, scale=Dk**-0.5, return_variance=False, chunk_size=chunk_size,
        block_v=block_v, num_warps=num_warps, backward_block_v=backward_block_v,
        backward_num_warps=backward_num_warps, time_splits=time_splits or None,
        backward_time_splits=backward_time_splits or None, design=design, precision=precision)
    return o.astype(xs["v"].dtype)


def palimpsa_inputs(key, shape, dtype) -> tuple[dict, jax.Array]:
    """`kernel_speed.make_inputs` restricted to palimpsa_attention's arguments, and w."""
    xs, w = bench.make_inputs(key, shape, dtype)
    return {name: xs[name] for name in bench.OPS["palimpsa"][1]}, w


def loss_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda xs, w: jnp.vdot(fn(xs).astype(jnp.float32), w)))


def check_inputs(key):
    """Small float32 inputs and the xla backend's o and gradients on them: the reference every
    configuration is checked against (computed once)."""
    xs, w = palimpsa_inputs(key, bench.Shape("check", 2, 512, 4, 48, 48), jnp.float32)
    xla = lambda xs: kernels.palimpsa_attention(**xs, backend="xla")
    return xs, w, jax.jit(xla)(xs), loss_and_grads(xla)(xs, w)[1]


def check(config, design, precision, xs, w, o_xla, grads_xla) -> float:
    """Largest relative error of o and of every gradient against the xla backend's."""
    fn = lambda xs: attention(xs, *config, design=design, precision=precision)
    errors = [bench.relative_error(jax.jit(fn)(xs), o_xla)]
    _, grads = loss_and_grads(fn)(xs, w)
    errors += [bench.relative_error(grads[n], grads_xla[n]) for n in grads]
    return max(errors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["lm_170m", "long_seq"],
                        choices=sorted(bench.SHAPES))
    parser.add_argument("--configs", nargs="+", default=["8,2,8,4,16", "8,4,8,4,16"],
                        help="block_v,num_warps,backward_block_v,backward_num_warps,C"
                             "[,time_splits,backward_time_splits]")
    parser.add_argument("--design", choices=pallas_gpu.DESIGNS, default="recurrent")
    parser.add_argument("--precision", choices=pallas_gpu_parallel.PRECISIONS, default=None,
                        help="the parallel design's matrix multiplies (default float32)")
    parser.add_argument("--time-limit-s", type=float, default=300)
    parser.add_argument("--skip-check", action="store_true",
                        help="time only (configurations whose fp32 check passed in an earlier run)")
    parser.add_argument("--profile-once", action="store_true",
                        help="run each configuration's forward+backward twice at each shape, no "
                             "check and no timing: a target for a profiler such as ncu")
    args = parser.parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    attention_of = lambda config: lambda xs: attention(xs, *config, design=args.design,
                                                       precision=args.precision)
    if args.profile_once:
        for name in args.shapes:
            xs, w = palimpsa_inputs(jax.random.key(0), bench.SHAPES[name], jnp.bfloat16)
            for config in configs:
                fn = loss_and_grads(attention_of(config))
                for _ in range(2):
                    jax.block_until_ready(fn(xs, w))
        return 0
    start = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    failed = False
    reference = None if args.skip_check else check_inputs(jax.random.key(1))
    for config in configs * (reference is not None):
        error = check(config, args.design, args.precision, *reference)
        failed |= not error < bench.TOLERANCE
        print(f"check config {config}: max relative error {error:.2e}", flush=True)
    rows = []
    for name in args.shapes:
        shape = bench.SHAPES[name]
        inputs = [palimpsa_inputs(jax.random.key(i), shape, jnp.bfloat16) for i in range(2)]
        for config in configs:
            if time.perf_counter() - start > args.time_limit_s:
                print(f"time limit: skipped {name} {config}")
                continue
            fn = attention_of(config)
            medians = []
            for program, arg_sets in [(jax.jit(fn), [(xs,) for xs, _ in inputs]),
                                      (loss_and_grads(fn), inputs)]:
                compiled = program.lower(*arg_sets[0]).compile()
                medians.append(statistics.median(bench.time_ms(compiled, arg_sets, 20, 1.0)))
            setting = " ".join(filter(None, [args.design, args.precision, str(config)]))
            rows.append([shape.name, shape.dims, setting, f"{medians[0]:.3f}", f"{medians[1]:.3f}",
                         f"{100 * shape.ceiling_ms('fwd') / medians[0]:.1f}",
                         f"{100 * shape.ceiling_ms('fwd+bwd') / medians[1]:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    print(bench.markdown_table(["shape", "(B, T, H, Dk, Dv)",
                                "design, precision, (fwd block_v, warps; bwd block_v, warps; C"
                                "[; splits fwd, bwd])",
                                "fwd ms", "fwd+bwd ms", "fwd % ceiling", "fwd+bwd % ceiling"], rows))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
