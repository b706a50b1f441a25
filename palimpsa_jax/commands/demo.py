"""Kernel demo: a synthetic key-value stream through metaplastic attention.

Run `palimpsa-demo` (or `python -m palimpsa_jax.commands.demo`). It draws one stream where a few keys
recur, runs `kernels.palimpsa_attention` on every backend, checks that they agree and that their
gradients agree, and prints how importance accumulated on the recurring keys. It runs the
reference and xla backends, and the Pallas backend of the current accelerator if there is one.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from palimpsa_jax import kernels


def key_value_stream(seed: int, length: int, heads: int, dk: int, dv: int, recurring: int):
    """One sequence of (q, k, v, beta, log_alpha) where `recurring` of dk one-hot keys repeat often.

    Returns q, k (1, T, H, Dk); v, beta (1, T, H, Dv); log_alpha (1, T, H); key index (T,).
    """
    rng = np.random.default_rng(seed)
    frequent = rng.random(length) < 0.8
    key = np.where(frequent, rng.integers(0, recurring, length), rng.integers(recurring, dk, length))
    k = np.broadcast_to(np.eye(dk, dtype=np.float32)[key][None, :, None], (1, length, heads, dk))
    q = rng.normal(size=(1, length, heads, dk)).astype(np.float32)
    v = rng.normal(size=(1, length, heads, dv)).astype(np.float32)
    beta = np.full((1, length, heads, dv), 0.5, np.float32)
    log_alpha = np.full((1, length, heads), np.log(0.995), np.float32)
    return q, np.ascontiguousarray(k), v, beta, log_alpha, key


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens T")
    parser.add_argument("--heads", type=int, default=4, help="heads H")
    parser.add_argument("--dk", type=int, default=16, help="key size Dk (one-hot keys)")
    parser.add_argument("--dv", type=int, default=16, help="value size Dv")
    parser.add_argument("--recurring", type=int, default=4, help="how many keys recur")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.recurring < args.dk:
        parser.error("--recurring must be between 1 and dk - 1")

    q, k, v, beta, log_alpha, key = key_value_stream(args.seed, args.length, args.heads, args.dk,
                                                      args.dv, args.recurring)
    prior = jnp.ones(args.heads, jnp.float32)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; stream T={args.length}, "
          f"H={args.heads}, Dk={args.dk}, Dv={args.dv}, {args.recurring} recurring keys")

    native = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(jax.default_backend(), [])
    backends = ["reference", "xla", *native]
    print(f"  (not run here: {', '.join(sorted(set(kernels.PALIMPSA_BACKENDS) - set(backends)))}, "
          "which need their accelerator or interpret=True)")
    results = {}
    for backend in backends:
        fn = jax.jit(lambda *a, backend=backend: kernels.palimpsa_attention(
            *a, backend=backend, return_final_state=True, return_variance=True))
        fn(q, k, v, beta, log_alpha, prior)[0].block_until_ready()
        start = time.perf_counter()
        results[backend] = jax.block_until_ready(fn(q, k, v, beta, log_alpha, prior))
        print(f"  backend {backend:>9}: {1e3 * (time.perf_counter() - start):8.2f} ms")

    reference = results.pop("reference")
    loss = lambda backend: jax.grad(lambda *a: jnp.sum(kernels.palimpsa_attention(
        *a, backend=backend) ** 2), argnums=tuple(range(6)))(q, k, v, beta, log_alpha, prior)
    grads_reference = loss("reference")
    for backend, result in results.items():
        relative = lambda xs, ys: max(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
                                      for x, y in zip(jax.tree.leaves(xs), jax.tree.leaves(ys)))
        print(f"  {backend} vs reference: relative error of outputs/state/variance "
              f"{relative(result, reference):.1e}, of gradients "
              f"{relative(loss(backend), grads_reference):.1e}")

    _, (mu, importance), variance = reference
    per_key = np.asarray(importance[0, 0].mean(axis=0))  # mean over Dv rows, one value per key
    counts = np.bincount(key, minlength=args.dk)
    print("\nhead 0, per key: occurrences, final importance I (prior = 1), plasticity 1/I")
    for index in np.argsort(-counts)[: args.recurring + 3]:
        print(f"  key {index:2d}: {counts[index]:5d} times, I = {per_key[index]:7.2f}, "
              f"1/I = {1 / per_key[index]:.3f}")
    print(f"mean predictive variance over the last 100 tokens: {float(variance[0, -100:].mean()):.4f}")


if __name__ == "__main__":
    main()
