"""Tuning sweep of the chunked Pallas GPU kernels per shape: GLA's (`kernels/gla/pallas_gpu.py`)
or, with --op gated_delta, the gated delta rule's (`kernels/gated_deltanet/pallas_gpu.py`).

Times forward and forward+backward (the loss <o, w> and its gradient) of the op's pallas_gpu
backend for each configuration C,num_warps,block,num_stages[,backward_num_warps] (chunk size, warps of
the forward's kernels (and of the backward's, unless given), the state / value tile width, the
sequential kernels' load pipelining depth), beside the relative
error of its output against the xla backend in the same dtype. Prints one line per case and a
Markdown table last.

    python -m benchmarks.gla_sweep --shapes mamba2 long_seq --configs 64,4,64,2 64,8,64,2
    python -m benchmarks.gla_sweep --op gated_delta --shapes lm_170m gated_deltanet
    python -m benchmarks.gla_sweep --op gated_delta --configs 32,4,64,2 32,2,64,2,4
    python -m benchmarks.gla_sweep --shapes tiny --configs 16,4,16,1 --interpret   # CPU smoke run
    ncu --kernel-name regex:gated_delta python -m benchmarks.gla_sweep --op gated_delta \
        --profile-once --shapes gated_deltanet --configs 32,4,64,2     # a target for Nsight Compute
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import kernel_speed as bench
from palimpsa_jax.kernels import chunking
from palimpsa_jax.kernels.gated_deltanet.pallas_gpu import gated_delta_pallas_gpu
from palimpsa_jax.kernels.gla.pallas_gpu import gla_pallas_gpu

SHAPES = {**bench.SHAPES, "mamba2": bench.Shape("mamba2", 8, 2048, 24, 128, 64),
          "gated_deltanet": bench.Shape("gated_deltanet", 8, 2048, 6, 128, 256)}


PALLAS_GPU = {"gla": gla_pallas_gpu, "gated_delta": gated_delta_pallas_gpu}


def attention(op: str, *inputs, chunk_size: int, num_warps: int, block: int, num_stages: int,
              backward_num_warps: int | None = None, interpret: bool = False):
    """The op through its pallas_gpu backend with explicit tuning options."""
    q, v = inputs[0], inputs[2]
    reset, log_alpha = chunking.resets(None, inputs[-1])
    S0 = jnp.zeros((q.shape[0], q.shape[2], v.shape[-1], q.shape[-1]), jnp.float32)
    o, _ = PALLAS_GPU[op](*inputs[:-1], log_alpha, S0, reset, scale=q.shape[-1]**-0.5,
                          chunk_size=chunk_size, block=block, num_warps=num_warps,
                          num_stages=num_stages, backward_num_warps=backward_num_warps,
                          interpret=interpret)
    return o


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(PALLAS_GPU), default="gla")
    parser.add_argument("--shapes", nargs="+", default=["lm_170m", "mamba2", "long_seq"],
                        choices=sorted(SHAPES))
    parser.add_argument("--configs", nargs="+", default=["64,4,64,2", "64,8,64,2", "64,4,32,2"],
                        help="C,num_warps,block,num_stages[,backward_num_warps]")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--time-limit-s", type=float, default=300)
    parser.add_argument("--interpret", action="store_true",
                        help="Pallas interpret mode (a CPU smoke run, with --shapes tiny)")
    parser.add_argument("--profile-once", action="store_true",
                        help="run each case's forward, then its forward+backward, once each, "
                             "with no check and no timing (for a profiler such as ncu)")
    args = parser.parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    start = time.perf_counter()
    print(f"{args.op}: jax {jax.__version__} on {jax.devices()[0].device_kind}, {args.dtype}",
          flush=True)
    rows = []
    for name in args.shapes:
        xs, w = bench.make_inputs(jax.random.key(0), SHAPES[name], jnp.dtype(args.dtype))
        entry, names = bench.OPS[args.op]
        inputs = tuple(xs[name] for name in names)
        expected = (None if args.profile_once else
                    jax.jit(lambda *a, entry=entry: entry(*a, backend="xla"))(*inputs))
        for config in configs:
            if time.perf_counter() - start > args.time_limit_s:
                print(f"time limit: skipped {name} {config}", flush=True)
                continue
            options = dict(zip(("chunk_size", "num_warps", "block", "num_stages",
                                "backward_num_warps"), config))
            forward = jax.jit(lambda *a, options=options: attention(
                args.op, *a, **options, interpret=args.interpret))
            backward = jax.jit(jax.value_and_grad(   # the loss too: XLA keeps the forward
                lambda *a, f=forward, w=w: jnp.vdot(f(*a).astype(jnp.float32), w),
                argnums=tuple(range(len(inputs)))))
            if args.profile_once:
                for program in (forward, backward):
                    jax.block_until_ready(program(*inputs))
                continue
            error = bench.relative_error(forward(*inputs), expected)
            medians = [statistics.median(bench.time_ms(program, [inputs], 15, 1.0))
                       for program in (forward, backward)]
            rows.append([name, SHAPES[name].dims, ",".join(map(str, config)),
                         f"{medians[0]:.3f}", f"{medians[1]:.3f}", f"{error:.1e}"])
            print(" | ".join(rows[-1]), flush=True)
    print(bench.markdown_table(["shape", "(B, T, H, Dk, Dv)", "C, warps, block, stages[, bwd warps]",
                                "fwd ms",
                                "fwd+bwd ms", "o rel. err. vs xla"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
