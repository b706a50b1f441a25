"""Replicas: the points of an MQAR grid that share a model (learning rates x seeds) trained
together as one compiled program on one device.

An MQAR model has about a million parameters: one run leaves a GPU nearly idle, and a Python
input pipeline takes as long as a step. Here the data set is materialised once (in worker
processes, cached in the grid's workdir), lives on the device, and every step gathers its batch
there; the R replicas' parameters and optimiser states are stacked and trained by one
`jax.vmap`ped step, each with its own learning rate, seed (parameters and data order) and early
stop (a finished replica's parameters stop changing). The result of a replica does not depend
on the others it trains with (tested: two replicas together equal each alone). A group of one
trains unbatched: the replica axis of `jax.vmap` turns the gathers of the tied embedding and of
the loss into batched gathers, which cost a small model's step about 10% in transposes on a GPU.

Per replica, as a plain run: <point>/config.json, metrics.jsonl, environment.jsonl, tensorboard/,
and at the end metrics.json and checkpoints/<its last step> (its parameters, read by
`analysis.load_run`, palimpsa-analyze and palimpsa-eval). Per group: <group>/checkpoints/<step>
(the stacked state), so an interrupted grid resumes from its last checkpoint.

Data order: pass p over the N training examples is the permutation of `fold_in(seed, p)`, cut
into N // B full batches (the remainder of a pass is left out of that pass); schedules and
evaluation count steps as the config says. The permutations are drawn once per pass
(`pass_orders`), not in every step.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from palimpsa_jax.data.mqar import IGNORE, MQARSource
from palimpsa_jax.models import CausalLM, weight_decay_mask
from palimpsa_jax.training import checkpoint, environment, metrics, optim, preemption
from palimpsa_jax.training.config import ConfigError, changed_keys, check_config
from palimpsa_jax.training.trainer import flop_rate, scored_metrics, token_metrics

# Keys in which the replicas of one group may differ.
REPLICA_KEYS = ("seed", "optim.lr")
# Keys that do not change a replica's results.
NO_EFFECT = ("log", "checkpoint", "mesh", "sharding")


# --- grouping -------------------------------------------------------------------------------

def trains(point: ml_collections.ConfigDict) -> bool:
    """Whether replicas train `point`: an MQAR point of full batches (train.grad_accum 1)."""
    return point.data.kind == "mqar" and point.train.grad_accum == 1


def group_points(points: Sequence[ml_collections.ConfigDict]) -> list[list[int]]:
    """Indices of the points, grouped by everything but the seed and the learning rate."""
    groups: dict[str, list[int]] = {}
    for i, point in enumerate(points):
        key = json.loads(point.to_json_best_effort())
        for name in REPLICA_KEYS + NO_EFFECT:
            section, _, leaf = name.rpartition(".")
            (key[section] if section else key).pop(leaf)
        groups.setdefault(json.dumps(key, sort_keys=True), []).append(i)
    return list(groups.values())


# --- data -----------------------------------------------------------------------------------

def _examples(args) -> tuple[np.ndarray, np.ndarray]:
    """Examples [start, stop) of an MQARSource (a worker process's share)."""
    source_args, start, stop = args
    source = MQARSource(*source_args)
    items = [source[i] for i in range(start, stop)]
    return (np.stack([x["tokens"] for x in items]), np.stack([x["labels"] for x in items]))


def _spawn_works() -> bool:
    """Spawned workers re-import the main module: it must be a file (not stdin or `-c`)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return main is None or pathlib.Path(main).is_file()   # None: an interactive session


def materialise(data_config, split: str, seq_len: int, num_pairs: int,
                cache_dir: pathlib.Path | None = None, workers: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """All examples of an MQAR split as (tokens, labels), each int32 (num_examples, seq_len):
    exactly `MQARSource`'s examples (about 0.25 ms each in Python), made in `workers` spawned
    processes (default: up to 16; one process when fewer than 10,000 examples, or when the main
    module cannot be re-imported) and cached as .npz in cache_dir. A script that calls this
    guards its top level with `if __name__ == "__main__":`, as multiprocessing requires."""
    num = data_config.num_train if split == "train" else data_config.num_test
    source_args = (split, num, data_config.vocab_size, seq_len, num_pairs, data_config.seed,
                   data_config.power_a)
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(repr(source_args).encode()).hexdigest()[:16]
        path = pathlib.Path(cache_dir) / f"mqar_{split}_{seq_len}_{num_pairs}_{digest}.npz"
        if path.exists():
            cached = np.load(path)
            return cached["tokens"], cached["labels"]
    MQARSource(*source_args)       # checks the settings (errors name the argument) before forking
    if workers is None:
        workers = min(16, multiprocessing.cpu_count()) if num >= 10_000 and _spawn_works() else 1
    bounds = np.linspace(0, num, workers + 1).astype(int)
    tasks = [(source_args, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if len(tasks) > 1:
        with multiprocessing.get_context("spawn").Pool(len(tasks)) as pool:
            parts = pool.map(_examples, tasks)
    else:
        parts = [_examples(t) for t in tasks]
    tokens, labels = (np.concatenate(p) for p in zip(*parts))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=tokens, labels=labels)
    return tokens, labels


# --- the vmapped program -----------------------------------------------------------------------

class ReplicaGroup:
    """R points that share a model, trained as one vmapped program.

    All points must be MQAR configs equal but for `seed` and `optim.lr` (see `group_points`).
    """

    def __init__(self, points: Sequence[ml_collections.ConfigDict], *,
                 cache_dir: pathlib.Path | None = None):
        self.points = list(points)
        c = self.config = self.points[0]
        for point in self.points[1:]:
            changed = changed_keys(json.loads(c.to_json_best_effort()),
                                   json.loads(point.to_json_best_effort()),
                                   REPLICA_KEYS + NO_EFFECT)
            if changed:
                raise ConfigError(f"replicas of one group must differ only in {REPLICA_KEYS}, "
                                  f"got differences in {changed}")
        if c.data.kind != "mqar":
            raise ConfigError(f"data.kind: replicas train MQAR only, got {c.data.kind!r}")
        if c.train.grad_accum != 1:
            raise ConfigError("train.grad_accum: replicas train full batches (set 1)")
        self.model_config = check_config(c, {"data": 1, "fsdp": 1, "tensor": 1})
        self.num = len(self.points)
        self.flop_rate = flop_rate(c, self.model_config, jax.devices()[:1])
        self.seeds = jnp.asarray([p.seed for p in self.points], jnp.uint32)
        self.lrs = jnp.asarray([p.optim.lr for p in self.points], jnp.float32)

        tokens, labels = materialise(c.data, "train", c.data.seq_len, c.data.num_pairs, cache_dir)
        if not np.all(np.sum(labels != IGNORE, axis=1) == c.data.num_pairs):
            raise ValueError(f"every training example must score data.num_pairs = "
                             f"{c.data.num_pairs} tokens (the loss keeps that many a row)")
        self.train_data = (jnp.asarray(tokens), jnp.asarray(labels))
        self.batches_per_pass = len(tokens) // c.batch_size
        if self.batches_per_pass == 0:
            raise ConfigError(f"data.num_train ({len(tokens)}) must be at least batch_size "
                              f"({c.batch_size})")
        slices = c.data.get("eval_slices") or [(c.data.seq_len, c.data.num_pairs)]
        self.test_data = {f"seq{s}_pairs{p}": tuple(map(jnp.asarray, materialise(
            c.data, "test", int(s), int(p), cache_dir))) for s, p in slices}

        model = nnx.eval_shape(lambda: CausalLM(self.model_config, rngs=nnx.Rngs(0)))
        self.graphdef, params, _ = nnx.split(model, nnx.Param, ...)
        # the schedule's shape (peak 1); each replica scales its update by its own rate
        self.tx, self.schedule = optim.optimizer(c.optim, c.train.steps, params,
                                                 weight_decay_mask(model), peak=1.0)
        self.abstract_state = jax.eval_shape(self._init_state)
        self.init_state = jax.jit(self._init_state)
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step)
        self._pass_orders = jax.jit(self._orders)
        self._cached_orders: tuple[int, jax.Array] | None = None

    # --- state ----------------------------------------------------------------------------

    def _init_one(self, seed):
        model = CausalLM(self.model_config, rngs=nnx.Rngs(params=jax.random.key(seed)))
        _, params, constants = nnx.split(model, nnx.Param, ...)
        return {"params": params, "constants": constants, "opt_state": self.tx.init(params)}

    def _init_state(self) -> dict:
        """Stacked replica states (leading axis R), the step and per-replica bookkeeping:
        done (R,) bool, the replica's stop step (R,) int32 (0 while it runs)."""
        state = jax.vmap(self._init_one)(self.seeds)
        return {**state, "step": jnp.zeros((), jnp.int32), "done": jnp.zeros(self.num, bool),
                "stopped_at": jnp.zeros(self.num, jnp.int32)}

    # --- steps ----------------------------------------------------------------------------

    def _orders(self, pass_):
        """(R, N) int32: each replica's order of the N training examples in pass `pass_`."""
        num = self.train_data[0].shape[0]
        return jax.vmap(lambda seed: jax.random.permutation(
            jax.random.fold_in(jax.random.key(seed), pass_), num))(self.seeds)

    def pass_orders(self, step: int) -> jax.Array:
        """(R, N): the orders of the pass that `step` (0-based) belongs to, drawn once a pass."""
        pass_ = step // self.batches_per_pass
        if self._cached_orders is None or self._cached_orders[0] != pass_:
            self._cached_orders = (pass_, self._pass_orders(pass_))
        return self._cached_orders[1]

    def _batch(self, order, step):
        """The replica's batch at `step` (0-based) of its pass order (N,), gathered on the
        device."""
        size = self.config.batch_size
        position = step % self.batches_per_pass
        index = jax.lax.dynamic_slice_in_dim(order, position * size, size)
        return {"tokens": self.train_data[0][index], "labels": self.train_data[1][index]}

    def _loss(self, params, constants, batch):
        model = nnx.merge(self.graphdef, params, constants)
        total, correct, count = scored_metrics(model, batch, self.config.data.num_pairs)
        count = jnp.maximum(count, 1).astype(jnp.float32)
        return total / count, correct / count

    def _train_one(self, replica, order, lr, done, step):
        """One step of one replica; `done` None: it trains on (a group of one stops by leaving
        the loop), else a done replica keeps its parameters and optimiser state."""
        batch = self._batch(order, step)
        (loss, accuracy), grads = jax.value_and_grad(self._loss, has_aux=True)(
            replica["params"], replica["constants"], batch)
        updates, opt_state = self.tx.update(grads, replica["opt_state"], replica["params"])
        params = optax.apply_updates(replica["params"], jax.tree.map(lambda u: lr * u, updates))
        if done is not None:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(done, o, n), new, old)
            params, opt_state = keep(params, replica["params"]), keep(opt_state,
                                                                      replica["opt_state"])
        new = {**replica, "params": params, "opt_state": opt_state}
        return new, {"loss": loss, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads),
                     "learning_rate": lr * self.schedule(step)}

    def _train_step(self, state: dict, orders) -> tuple[dict, dict]:
        """One step of every replica, its batch taken from its pass order in orders (R, N)
        (`pass_orders(state["step"])`); metrics (R,) each."""
        replicas = {k: state[k] for k in ("params", "constants", "opt_state")}
        if self.num == 1:
            one = jax.tree.map(lambda x: x[0], (replicas, orders, self.lrs))
            replicas, step_metrics = jax.tree.map(
                lambda x: x[None], self._train_one(*one, None, state["step"]))
        else:
            replicas, step_metrics = jax.vmap(self._train_one, in_axes=(0, 0, 0, 0, None))(
                replicas, orders, self.lrs, state["done"], state["step"])
        return {**state, **replicas, "step": state["step"] + 1}, step_metrics

    def _eval_step(self, state: dict, tokens, labels):
        """(loss sum, correct, count) per replica (R,) on one batch of test examples."""
        def one(replica):
            model = nnx.merge(self.graphdef, replica["params"], replica["constants"])
            return token_metrics(model(tokens)[0], labels)
        return jax.vmap(one)({k: state[k] for k in ("params", "constants")})

    def evaluate(self, state: dict) -> list[dict[str, float]]:
        """Per replica: loss and accuracy per test slice and overall."""
        size = self.config.eval.batch_size
        results = [{} for _ in range(self.num)]
        totals = np.zeros((self.num, 3))
        for name, (tokens, labels) in self.test_data.items():
            sums = np.zeros((self.num, 3))
            for start in range(0, tokens.shape[0], size):
                batch = (tokens[start:start + size], labels[start:start + size])
                sums += np.stack([np.asarray(x, np.float64) for x in
                                  self.eval_step(state, *batch)], axis=1)
            totals += sums
            for r in range(self.num):
                loss, correct, count = sums[r]
                results[r][f"eval/{name}/loss"] = float(loss / max(count, 1))
                results[r][f"eval/{name}/accuracy"] = float(correct / max(count, 1))
        for r in range(self.num):
            loss, correct, count = totals[r]
            results[r]["eval/loss"] = float(loss / max(count, 1))
            results[r]["eval/accuracy"] = float(correct / max(count, 1))
        return results


def _is_due(step: int, every: int, is_last: bool) -> bool:
    return is_last or bool(every and step % every == 0)


def train_group(points: Sequence[ml_collections.ConfigDict], run_dirs: Sequence[pathlib.Path],
                group_dir: pathlib.Path, *, cache_dir: pathlib.Path | None = None,
                desc: str = "replicas") -> list[dict]:
    """Trains the points (one group) to the end or their early stop, resuming from the group's
    last checkpoint; returns each replica's final metrics (also its run dir's metrics.json).
    On SIGTERM it writes the group's checkpoint after the current step and raises
    `preemption.Preempted`."""
    group = ReplicaGroup(points, cache_dir=cache_dir)
    c = group.config
    writers = []
    for point, run_dir in zip(points, run_dirs):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(
            json.loads(point.to_json_best_effort()), indent=2) + "\n")
        writers.append(metrics.MetricWriter(run_dir))
    ckpt = checkpoint.Checkpoints(group_dir, every_steps=c.checkpoint.every_steps,
                                  keep=c.checkpoint.keep, async_save=c.checkpoint.async_save)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpoint.abstract(group.abstract_state,
                                   jax.tree.map(lambda _: device, group.abstract_state))
    if ckpt.latest_step() is not None:
        start, state, _ = ckpt.restore(abstract)
        for writer in writers:
            writer.truncate(start)
    else:
        start, state = 0, group.init_state()
    environment.record(run_dirs, start)
    steps, stop_at = c.train.steps, c.train.get("early_stop_accuracy")
    finals = [{} for _ in points]
    done = np.asarray(state["done"])
    progress = tqdm(total=steps, initial=start, dynamic_ncols=True, desc=desc,
                    disable=not c.log.progress)
    clock, clock_step = time.perf_counter(), start
    try:
        with preemption.StopOnSigterm() as sigterm:
            for step in range(start + 1, steps + 1):
                if done.all():       # stopped early (also when resumed at that stop)
                    break
                state, step_metrics = group.train_step(state, group.pass_orders(step - 1))
                progress.update(1)
                is_last = step == steps
                if _is_due(step, c.log.every_steps, is_last):
                    values = jax.device_get(step_metrics)
                    now = time.perf_counter()
                    seconds_per_step = (now - clock) / max(step - clock_step, 1)
                    clock, clock_step = now, step
                    tokens_per_s = c.batch_size * c.data.seq_len / seconds_per_step
                    speed = {"train/seconds_per_step": seconds_per_step,
                             "train/tokens_per_s": tokens_per_s}
                    # the device's MFU: the tokens of all R replicas (a stopped one still computes)
                    mfu = group.flop_rate.mfu(group.num * tokens_per_s)
                    if mfu is not None:
                        speed["train/mfu"] = mfu
                    for r, writer in enumerate(writers):
                        if not done[r]:
                            writer.scalars(step, {**{f"train/{k}": v[r] for k, v in values.items()},
                                                  **speed})
                            finals[r].update({f"train/{k}": float(v[r]) for k, v in values.items()})
                            finals[r].update(speed)
                    progress.set_postfix(running=f"{int((~done).sum())}/{group.num}",
                                         s_step=f"{seconds_per_step:.3g}",
                                         **({} if mfu is None else {"mfu": f"{mfu:.1%}"}))
                if _is_due(step, c.eval.every_steps, is_last):
                    results = group.evaluate(state)
                    stopping = np.zeros(group.num, bool)
                    for r, writer in enumerate(writers):
                        if done[r]:
                            continue
                        writer.scalars(step, results[r])
                        finals[r].update(results[r])
                        if stop_at is not None and results[r]["eval/accuracy"] > stop_at:
                            stopping[r] = True
                    if stopping.any():
                        done = done | stopping
                        state["done"] = jnp.asarray(done)
                        state["stopped_at"] = jnp.where(jnp.asarray(stopping), step,
                                                        state["stopped_at"])
                preempted = sigterm.requested(step)
                if ckpt.due(step, force=is_last or bool(done.all()) or preempted):
                    for writer in writers:
                        writer.flush()
                    ckpt.save(step, state, {}, force=True)
                if preempted and not (is_last or done.all()):
                    raise preemption.Preempted(step, ckpt.directory)
    finally:
        progress.close()
        ckpt.close()
        for writer in writers:
            writer.close()
    stopped_at = np.asarray(state["stopped_at"])
    for r, (writer, run_dir) in enumerate(zip(writers, run_dirs)):
        if not finals[r]:   # resumed at its end: the last logged values
            records = writer.records()
            finals[r] = {k: v for record in records for k, v in record.items() if k != "step"}
        finals[r]["step"] = int(stopped_at[r]) or int(state["step"])
        if stopped_at[r]:
            finals[r]["train/stopped_early"] = 1.0
        _save_replica(state, r, finals[r]["step"], run_dir)
        writer.final(finals[r])
    return finals


def _save_replica(state: dict, index: int, step: int, run_dir: pathlib.Path) -> None:
    """Replica `index` of the stacked state, at its last step, as a run checkpoint in run_dir
    (the launcher's layout), so `analysis.load_run`, palimpsa-analyze and palimpsa-eval read a
    point of a grid like any run. Not for resuming with palimpsa-train: no data order is saved."""
    ckpt = checkpoint.Checkpoints(run_dir, every_steps=0, keep=1, async_save=False)
    try:
        if ckpt.latest_step() != step:
            replica = jax.tree.map(lambda x: x[index], {
                k: state[k] for k in ("params", "constants", "opt_state")})
            ckpt.save(step, {**replica, "step": jnp.asarray(step, jnp.int32)}, {}, force=True)
    finally:
        ckpt.close()
