"""Every Palimpsa backend of this platform, eager and under `jax.jit`, with `jax_enable_x64` off
and on, for each prior family: the relative error of the output, the final state and every
gradient against the float32 sequential reference. Prints a Markdown table; exits 1 if an error
exceeds the tolerance or a case fails. On a GPU this runs the real Pallas (Triton) kernels.

    python -m benchmarks.backend_modes [--shape 2 100 3 48 40]
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from palimpsa_jax import kernels

TOLERANCE = 1e-4
FAMILIES = {"head": lambda H, Dv, Dk: (H,), "row": lambda H, Dv, Dk: (H, Dv),
            "synapse": lambda H, Dv, Dk: (H, Dv, Dk)}


def inputs(B, T, H, Dk, Dv, family, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, Dk)).astype(np.float32)
    k = (rng.normal(size=(B, T, H, Dk)) / np.sqrt(Dk)).astype(np.float32)
    v = rng.normal(size=(B, T, H, Dv)).astype(np.float32)
    beta = rng.uniform(0.05, 2.0, size=(B, T, H, Dv)).astype(np.float32)
    log_alpha = (-rng.uniform(0.0, 1.0, size=(B, T, H)) ** 2).astype(np.float32)
    prior = rng.uniform(0.3, 3.0, size=FAMILIES[family](H, Dv, Dk)).astype(np.float32)
    segment_ids = np.cumsum(rng.uniform(size=(B, T)) < 0.05, axis=1).astype(np.int32)
    return (q, k, v, beta, log_alpha, prior), segment_ids


def outputs_and_grads(backend, args, segment_ids, jit: bool):
    def loss(*a):
        out = kernels.palimpsa_attention(*a, segment_ids=segment_ids, backend=backend,
                                         return_final_state=True, return_variance=True)
        return (jnp.sum(out.o * jnp.cos(out.o)) + jnp.sum(out.variance)
                + jnp.sum(out.final_state.importance * 0.1)), out

    fn = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)
    (_, out), grads = (jax.jit(fn) if jit else fn)(*args)
    return jax.tree.leaves(out) + list(grads)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=5, default=[2, 100, 3, 48, 40],
                        metavar=("B", "T", "H", "Dk", "Dv"))
    parser.add_argument("--x64", type=int, nargs="+", choices=[0, 1], default=[0, 1],
                        help="64-bit modes to run (0: off, 1: on)")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args(argv)
    platform = jax.default_backend()
    native = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(platform, [])
    backends = ["xla", *native]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; shape (B, T, H, Dk, Dv) = "
          f"{tuple(args.shape)}, float32; max relative error over the output, final state, "
          f"variance and the 6 gradients, against backend 'reference'\n")
    print("| backend | x64 | jit | prior | max relative error |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for x64 in map(bool, args.x64):
        with jax.enable_x64(x64) if x64 else contextlib.nullcontext():
            for family in args.families:
                arrays, segment_ids = inputs(*args.shape, family)
                reference = outputs_and_grads("reference", arrays, segment_ids, jit=True)
                for backend in backends:
                    for jit in (False, True):
                        try:
                            result = outputs_and_grads(backend, arrays, segment_ids, jit)
                            error = max(relative(a, b) for a, b in zip(result, reference))
                            cell = f"{error:.2e}"
                        except Exception as e:   # reported in the table
                            error, cell = float("inf"), f"{type(e).__name__}: {str(e)[:80]}"
                        worst = max(worst, error)
                        print(f"| {backend} | {x64} | {jit} | {family} | {cell} |", flush=True)
    print(f"\nworst {worst:.2e} (tolerance {TOLERANCE})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
