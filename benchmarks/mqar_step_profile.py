"""Where an MQAR train step's time goes, per mixer: the recurrent kernel alone at the layer's
shape, the model's forward, forward+backward, and the whole trainer step (median of repeated
runs), and the top device operations of a profiled step (JAX profiler, Perfetto trace).

    python -m benchmarks.mqar_step_profile --mixers palimpsa_d --trace-dir /tmp/trace
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from palimpsa_jax import kernels, sharding
from palimpsa_jax.experiments.mqar import common
from palimpsa_jax.training import Trainer
from palimpsa_jax.training.replicas import materialise
from palimpsa_jax.training.trainer import token_metrics


def median_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def device_events(trace_dir: pathlib.Path) -> list[tuple[str, float]]:
    """(name, ms) of every device event of the Perfetto trace under trace_dir."""
    (path,) = sorted(trace_dir.rglob("perfetto_trace.json.gz"))[-1:]
    events = json.loads(gzip.open(path).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:" in e.get("args", {}).get("name", "")}
    pids = pids or {e.get("pid") for e in events}      # no device processes (CPU): every event
    return [(e["name"], e.get("dur", 0) / 1e3) for e in events
            if e.get("ph") == "X" and e.get("pid") in pids]


def device_ms(trace_dir: pathlib.Path) -> collections.Counter:
    """Total ms of each device event name of the Perfetto trace under trace_dir."""
    totals = collections.Counter()
    for name, ms in device_events(trace_dir):
        totals[name] += ms
    return totals


def top_ops(trace_dir: pathlib.Path, count: int) -> list[tuple[str, float]]:
    """(name, total ms) of the longest device events of the Perfetto trace under trace_dir."""
    return device_ms(trace_dir).most_common(count)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", default=["palimpsa_d"], choices=common.MIXERS)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--trace-dir", type=pathlib.Path)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    for mixer in args.mixers:
        rows = profile(mixer, args)
        print(f"\n{mixer} (backend {args.backend}, batch {args.batch} x {args.seq_len}, "
              f"{jax.devices()[0].device_kind})")
        for name, ms in rows.items():
            print(f"  {name:50s} {ms:9.2f} ms")
        if args.trace_dir:
            print("  top device ops over 3 profiled steps (total ms):")
            for name, ms in top_ops(args.trace_dir / mixer, 15):
                print(f"    {ms:9.2f}  {name[:100]}")


def profile(mixer: str, args) -> dict[str, float]:
    """Median ms of the model's forward, forward+backward, the trainer step and (Palimpsa
    mixers) the kernel alone; a trace of 3 steps under args.trace_dir/mixer if given."""
    c = common.paper(mixer, args.seq_len, args.pairs, args.batch)
    c.model.backend = args.backend
    c.data.num_train, c.data.num_test = 256, 8
    trainer = Trainer(c)
    tokens, labels = materialise(c.data, "train", c.data.seq_len, c.data.num_pairs)
    with sharding.use_mesh(trainer.mesh, trainer.rules):
        state = trainer.init_state()
        batch = trainer.global_batch({"tokens": tokens[:c.batch_size],
                                      "labels": labels[:c.batch_size]})
        graphdef, params, constants = nnx.split(trainer.model(state), nnx.Param, ...)

        def loss(params):
            logits, _ = nnx.merge(graphdef, params, constants)(batch["tokens"])
            total, _, count = token_metrics(logits, batch["labels"])
            return total / count

        forward, backward = jax.jit(loss), jax.jit(jax.grad(loss))
        rows = {"model forward": median_ms(lambda: forward(params), args.repeats),
                "model forward+backward": median_ms(lambda: backward(params), args.repeats)}
        holder = {"state": state}

        def step():
            holder["state"], out = trainer.train_step(holder["state"], batch)
            return out
        rows["trainer step"] = median_ms(step, args.repeats)
        if args.trace_dir:
            with jax.profiler.trace(str(args.trace_dir / mixer), create_perfetto_trace=True):
                for _ in range(3):
                    jax.block_until_ready(step())
    if mixer in ("palimpsa_d", "palimpsa_m"):
        B, T, m = c.batch_size, c.data.seq_len, c.model
        H, Dk, Dv = ((m.num_heads, m.head_dim, m.expand_v * m.head_dim) if mixer == "palimpsa_d"
                     else (2 * m.d_model // m.ssm_head_dim, m.ssm_state, m.ssm_head_dim))
        rng = np.random.default_rng(0)
        arrays = [jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in
                  [(B, T, H, Dk), (B, T, H, Dk), (B, T, H, Dv)]]
        arrays.append(jnp.asarray(rng.uniform(0.1, 1, size=(B, T, H, Dv)), jnp.bfloat16))
        arrays.append(jnp.asarray(-rng.uniform(0.001, 0.1, size=(B, T, H)), jnp.float32))
        arrays.append(jnp.ones(H))
        kernel = jax.jit(jax.grad(lambda *a: kernels.palimpsa_attention(
            *a, backend=args.backend).astype(jnp.float32).sum(), argnums=tuple(range(5))))
        rows[f"palimpsa kernel fwd+bwd {(B, T, H, Dk, Dv)}"] = median_ms(
            lambda: kernel(*arrays), args.repeats)
    return rows

if __name__ == "__main__":
    main()
