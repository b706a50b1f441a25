"""The training loop: `train_and_evaluate(config, workdir)`.

One `Trainer` per run builds the mesh once, checks the config against it, places parameters and
optimiser state by logical-axis rules, and holds the jitted train, eval and diagnostics steps
(explicit shardings, donated state, gradient accumulation inside the step, bf16 or the model's
compute over float32 master weights). `train_and_evaluate` enters the mesh once and runs the
loop: periodic evaluation (optionally stopping early), diagnostics, logging and asynchronous
checkpoints of the state and of the data iterator.

Files in the workdir: config.json (the resolved config), checkpoints/<step>/, tensorboard/,
metrics.jsonl (every logged step), metrics.json (final metrics), environment.jsonl (machine and
versions, one line per process start).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from palimpsa_jax import data, sharding
from palimpsa_jax.data.tokenizer import Tokenizer
from palimpsa_jax.models import CausalLM, count_params, flops, weight_decay_mask
from palimpsa_jax.training import checkpoint, diagnostics, environment, metrics, optim, preemption
from palimpsa_jax.training.config import ConfigError, changed_keys, check_config

Array = jax.Array
IGNORE = -100
# Keys of the config that may change when a run is resumed (the mesh too: checkpoints restore
# onto the shardings of the new mesh).
RESUMABLE_CHANGES = ("train.steps", "log", "eval.every_steps", "checkpoint.every_steps",
                     "checkpoint.keep", "mesh", "sharding")


def maybe_initialize_distributed() -> None:
    """jax.distributed.initialize() for multi-process runs: when JAX_COORDINATOR_ADDRESS is set
    (with JAX_NUM_PROCESSES and JAX_PROCESS_ID), or PALIMPSA_DISTRIBUTED=1 to let JAX detect the
    cluster (SLURM, Open MPI, Cloud TPU)."""
    if jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                                   int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))
    elif os.environ.get("PALIMPSA_DISTRIBUTED") == "1":
        jax.distributed.initialize()


def token_metrics(logits: Array, labels: Array) -> tuple[Array, Array, Array]:
    """Summed cross-entropy, number of correct argmax predictions and number of scored tokens
    (labels != -100); logits (B, T, V) float32, labels (B, T)."""
    scored = labels != IGNORE
    safe = jnp.where(scored, labels, 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    correct = (jnp.argmax(logits, -1) == safe) & scored
    return (jnp.sum(jnp.where(scored, losses, 0.0)), jnp.sum(correct, dtype=jnp.int32),
            jnp.sum(scored, dtype=jnp.int32))


def scored_positions(labels: Array, count: int) -> Array:
    """The positions of the first `count` scored labels (!= -100) of each row, ascending:
    labels (B, T) -> (B, count) int32. An MQAR batch scores exactly num_pairs tokens a row;
    in a row with fewer, the remaining positions are unscored ones (their labels stay -100)."""
    return jnp.argsort(labels == IGNORE, axis=-1, stable=True)[:, :count].astype(jnp.int32)


def scored_metrics(model, batch: dict, count: int | None) -> tuple[Array, Array, Array]:
    """token_metrics of `model` on `batch` (tokens, labels, optional segment_ids); with `count`
    (MQAR: num_pairs) the logits of the scored positions alone (`scored_positions`)."""
    tokens, labels = batch["tokens"], batch["labels"]
    positions = None if count is None else scored_positions(labels, count)
    logits, _ = model(tokens, segment_ids=batch.get("segment_ids"), positions=positions)
    if positions is not None:
        labels = jnp.take_along_axis(labels, positions, axis=1)
    return token_metrics(logits, labels)


@dataclasses.dataclass(frozen=True)
class FlopRate:
    """What MFU is computed from: the model FLOPs of one training token
    (`models.flops.train_flops_per_token`) and the peak FLOP/s of all the devices together;
    either is None when unknown, and then `why` says so and no MFU is logged."""
    flops_per_token: float | None
    peak: float | None
    devices: int
    why: str           # where the peak came from, or why MFU is not logged

    @property
    def known(self) -> bool:
        return self.flops_per_token is not None and self.peak is not None

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOP utilisation at `tokens_per_s` (all devices' tokens), or None."""
        return flops.mfu(tokens_per_s, self.flops_per_token, self.peak) if self.known else None

    def describe(self) -> str:
        """The FLOPs per token and the peak used, or why MFU is not logged (for summaries)."""
        count = ("" if self.flops_per_token is None else
                 f"{_si(self.flops_per_token, 'FLOP')} per token (train, 3 x forward); ")
        if not self.known:
            return f"{count}MFU not logged: {self.why}"
        return (f"{count}MFU against {_si(self.peak / self.devices, 'FLOP/s')} x "
                f"{self.devices} device(s) ({self.why})")


def _si(value: float, unit: str) -> str:
    """1.234e9, "FLOP" -> "1.234 GFLOP"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def flop_rate(config: ml_collections.ConfigDict, model_config, devices) -> FlopRate:
    """The FlopRate of a run over `devices` (a list of jax devices): the peak per device is
    config.log.peak_flops, or when None the `models.flops.PEAK_FLOPS` entry of the first
    device's kind (none for CPUs)."""
    try:
        per_token = flops.train_flops_per_token(model_config, config.data.seq_len)
    except ValueError as e:
        return FlopRate(None, None, len(devices), str(e))
    peak = config.log.get("peak_flops")
    kind = devices[0].device_kind
    if peak is not None:
        why = "log.peak_flops"
    else:
        peak = flops.peak_flops(kind)
        why = (f"the peak of a {kind}" if peak is not None else
               f"no peak FLOP/s known for device kind {kind!r} (set log.peak_flops)")
    return FlopRate(per_token, None if peak is None else peak * len(devices), len(devices), why)


class Trainer:
    """The model, optimiser, shardings and jitted steps of one config on one mesh.

    Construction builds the mesh (from config.mesh, over `devices` or all devices), checks the
    config against it (`ConfigError` naming the key) and creates `train_step`, `eval_step` and
    `diagnostics_step`, each a `jax.jit` with explicit shardings. Call them (and `init_state`,
    `evaluate`) inside `sharding.use_mesh(trainer.mesh, trainer.rules)`, as
    `train_and_evaluate` does, so that the kernels run per shard.
    """

    def __init__(self, config: ml_collections.ConfigDict, devices=None):
        self.config = config
        try:
            self.mesh = sharding.make_mesh(config.mesh.to_dict(), devices)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.model_config = check_config(config, dict(self.mesh.shape))
        self.rules = tuple(tuple(rule) for rule in config.sharding.rules)   # checked above
        self.batch_sharding = NamedSharding(self.mesh, sharding.logical_spec(("batch", None),
                                                                             self.rules))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

        model = nnx.eval_shape(lambda: CausalLM(self.model_config, rngs=nnx.Rngs(config.seed)))
        self.graphdef, params, constants = nnx.split(model, nnx.Param, ...)
        self.tx, self.schedule = optim.optimizer(config.optim, config.train.steps, params,
                                                 weight_decay_mask(model))
        shardings = {"params": sharding.state_shardings(params, self.mesh, self.rules),
                     "constants": sharding.state_shardings(constants, self.mesh, self.rules)}
        opt_state = jax.eval_shape(self.tx.init, params)
        shardings["opt_state"] = optax.tree_map_params(
            self.tx, lambda _, s: s, opt_state, shardings["params"],
            transform_non_params=lambda _: self.replicated)
        shardings["step"] = self.replicated
        self.state_shardings = shardings
        self.abstract_state = checkpoint.abstract(
            {"params": params, "constants": constants, "opt_state": opt_state,
             "step": jax.ShapeDtypeStruct((), jnp.int32)}, shardings)

        state_and_batch = (self.state_shardings, self.batch_sharding)
        self.train_step = jax.jit(self._train_step, in_shardings=state_and_batch,
                                  out_shardings=(self.state_shardings, self.replicated),
                                  donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step, in_shardings=state_and_batch,
                                 out_shardings=self.replicated)
        self.diagnostics_step = jax.jit(self._diagnostics_step, in_shardings=state_and_batch,
                                        out_shardings=self.replicated)
        self._init = jax.jit(self._init_state, in_shardings=(shardings["params"], shardings["constants"]),
                             out_shardings=self.state_shardings, donate_argnums=(0, 1))
        self.flop_rate = flop_rate(config, self.model_config, list(self.mesh.devices.flat))

    def summary(self) -> str:
        """Devices, mesh, parameter count, tokens per step and model FLOPs per token (with the
        peak MFU is measured against), for the start of a run."""
        c = self.config
        devices = jax.devices()
        mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh.shape.items())
        return (f"{len(devices)} {devices[0].platform} device(s) in {jax.process_count()} "
                f"process(es); mesh {mesh}; {count_params(self.model_config) / 1e6:.3f}M "
                f"parameters; {c.batch_size * c.data.seq_len:,} tokens per step "
                f"({c.batch_size} x {c.data.seq_len}); {self.flop_rate.describe()}")

    # --- state ------------------------------------------------------------------------------

    def _init_state(self, params, constants) -> dict:
        return {"params": params, "constants": constants, "opt_state": self.tx.init(params),
                "step": jnp.zeros((), jnp.int32)}

    def init_state(self) -> dict:
        """Fresh parameters (from config.seed) and optimiser state, sharded.

        The model is built eagerly, each initializer compiled once per shape (bitwise the values
        of a jit of the whole construction, `layers.init`, which takes minutes to compile on a
        GPU), on one device of each process, then placed shard by shard."""
        model = CausalLM(self.model_config, rngs=nnx.Rngs(self.config.seed))
        _, params, constants = nnx.split(model, nnx.Param, ...)
        place = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index])
        return self._init(jax.tree.map(place, params, self.state_shardings["params"]),
                          jax.tree.map(place, constants, self.state_shardings["constants"]))

    def model(self, state: dict) -> nnx.Module:
        return nnx.merge(self.graphdef, state["params"], state["constants"])

    def global_batch(self, local: dict) -> dict:
        """This process's numpy batch -> global arrays sharded over data x fsdp."""
        return {name: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x))
                for name, x in local.items()}

    # --- steps ------------------------------------------------------------------------------

    def _forward(self, params, constants, batch, count=None):
        return scored_metrics(nnx.merge(self.graphdef, params, constants), batch, count)

    def _train_step(self, state: dict, batch: dict) -> tuple[dict, dict]:
        """One optimiser step over grad_accum micro-batches of the global batch."""
        accum = self.config.train.grad_accum
        micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

        # MQAR scores num_pairs tokens a row: the head computes their logits alone
        scored = self.config.data.num_pairs if self.config.data.kind == "mqar" else None

        def loss_sum(params, mb):
            total, correct, count = self._forward(params, state["constants"], mb, scored)
            return total, (correct, count)

        def accumulate(carry, mb):
            (total, (correct, count)), grads = jax.value_and_grad(loss_sum, has_aux=True)(
                state["params"], mb)
            return jax.tree.map(jnp.add, carry, (grads, total, correct, count)), None

        zeros = (jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros((), jnp.float32),
                 jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        (grads, total, correct, count), _ = jax.lax.scan(accumulate, zeros, micro)
        count_f = jnp.maximum(count, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: g / count_f, grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1}
        step_metrics = {"loss": total / count_f, "accuracy": correct / count_f,
                        "grad_norm": optax.tree.norm(grads),
                        "learning_rate": self.schedule(state["step"])}
        return new_state, step_metrics

    def _eval_step(self, state: dict, batch: dict) -> tuple[Array, Array, Array]:
        return self._forward(state["params"], state["constants"], batch)

    def _diagnostics_step(self, state: dict, batch: dict) -> dict[str, Array]:
        return diagnostics.metaplasticity(self.model(state), batch["tokens"],
                                          batch.get("segment_ids"))

    # --- evaluation -------------------------------------------------------------------------

    def evaluate(self, state: dict) -> dict[str, float]:
        """MQAR: accuracy (and loss) per (sequence length, pairs) slice and overall; text: loss
        and perplexity on data.test_path (no evaluation without one)."""
        c = self.config
        local = c.eval.batch_size // jax.process_count()
        shard = {"shard_index": jax.process_index(), "shard_count": jax.process_count()}
        if c.data.kind == "mqar":
            slices = data.mqar_eval_slices(c.data, batch_size=local, **shard)
            named = {f"seq{s}_pairs{p}": ds for (s, p), ds in slices.items()}
        elif c.data.get("test_path"):
            named = {"test": data.make_dataset(c.data, split="test", batch_size=local, seed=0,
                                               **shard)}
        else:
            return {}
        results, totals = {}, np.zeros(3)
        for name, dataset in named.items():
            sums = np.zeros(3)
            for batch in dataset:
                sums += np.array([float(x) for x in self.eval_step(state, self.global_batch(batch))])
            loss, correct, count = sums
            results[f"eval/{name}/loss"] = float(loss / max(count, 1))
            results[f"eval/{name}/accuracy"] = float(correct / max(count, 1))
            totals += sums
        loss, correct, count = totals
        results["eval/loss"] = float(loss / max(count, 1))
        results["eval/accuracy"] = float(correct / max(count, 1))
        if c.data.kind == "text":
            results["eval/perplexity"] = math.exp(min(results["eval/loss"], 80.0))
        return results


def _prepare_workdir(workdir: pathlib.Path, config, resume: bool) -> None:
    """Creates workdir and config.json (and a copy of data.tokenizer), or checks a resumed run's
    config against its own."""
    saved_path = workdir / "config.json"
    resolved = json.loads(config.to_json_best_effort())
    if resume:
        if not saved_path.exists():
            raise checkpoint.CheckpointError(f"--resume: {saved_path} does not exist; nothing to "
                                             f"resume in {workdir}")
        changed = changed_keys(json.loads(saved_path.read_text()), resolved, RESUMABLE_CHANGES)
        if changed:
            raise ConfigError(f"--resume: the config differs from the run's config.json in "
                              f"{changed}; only {RESUMABLE_CHANGES} may change")
    elif (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
        raise ConfigError(f"workdir {workdir} already holds checkpoints: pass --resume to "
                          f"continue that run, or choose a new workdir")
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        saved_path.write_text(json.dumps(resolved, indent=2) + "\n")
        if config.data.get("tokenizer"):     # evaluation and generation decode with it
            Tokenizer(config.data.tokenizer, eos_id=config.data.eos_id).save(workdir)


def _is_due(step: int, every: int, is_last: bool) -> bool:
    return is_last or bool(every and step % every == 0)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                       resume: bool = False) -> dict[str, float]:
    """Trains config.train.steps steps (continuing from the last checkpoint if resume; stopping
    at the first evaluation whose accuracy exceeds train.early_stop_accuracy, if set) and returns
    the final metrics (also written to workdir/metrics.json). On SIGTERM it writes a checkpoint
    after the current step and raises `preemption.Preempted`."""
    maybe_initialize_distributed()
    workdir = pathlib.Path(workdir)
    trainer = Trainer(config)                        # validates the config first
    _prepare_workdir(workdir, config, resume)
    c = config
    lead = jax.process_index() == 0
    if lead:
        print(f"{workdir.name}: {trainer.summary()}", flush=True)
    writer = metrics.MetricWriter(workdir, enabled=lead)
    ckpt = checkpoint.Checkpoints(workdir, every_steps=c.checkpoint.every_steps,
                                  keep=c.checkpoint.keep, async_save=c.checkpoint.async_save)
    local_batch = c.batch_size // jax.process_count()
    dataset = data.make_dataset(c.data, split="train", batch_size=local_batch, seed=c.seed,
                                shard_index=jax.process_index(), shard_count=jax.process_count())
    batches = iter(dataset)
    steps, stop_at = c.train.steps, c.train.get("early_stop_accuracy")
    final, last = {}, {}
    progress = None
    try:
        with (sharding.use_mesh(trainer.mesh, trainer.rules),    # kernels run per shard
              preemption.StopOnSigterm() as sigterm):
            if resume:
                start, state, data_state = ckpt.restore(trainer.abstract_state)
                batches.set_state(data_state)
                writer.truncate(start)
            else:
                start, state = 0, trainer.init_state()
            if lead:
                environment.record([workdir], start)
            progress = tqdm(total=steps, initial=start, disable=not (lead and c.log.progress),
                            dynamic_ncols=True, desc=workdir.name)
            tokens_per_step = c.batch_size * c.data.seq_len
            clock, clock_step, step = time.perf_counter(), start, start
            for step in range(start + 1, steps + 1):
                batch = trainer.global_batch(next(batches))
                state, step_metrics = trainer.train_step(state, batch)
                progress.update(1)
                is_last = step == steps
                if _is_due(step, c.log.every_steps, is_last):
                    last = {f"train/{k}": float(v) for k, v in jax.device_get(step_metrics).items()}
                    now = time.perf_counter()
                    throughput = tokens_per_step * (step - clock_step) / (now - clock)
                    clock, clock_step = now, step
                    speed = {"train/tokens_per_s": throughput}
                    mfu = trainer.flop_rate.mfu(throughput)
                    postfix = {"loss": f"{last['train/loss']:.4f}", "tok_s": f"{throughput:.3g}"}
                    if mfu is not None:
                        speed["train/mfu"] = mfu
                        postfix["mfu"] = f"{mfu:.1%}"
                    writer.scalars(step, last)
                    writer.scalars(step, speed, record=False)
                    final.update(speed)
                    progress.set_postfix(postfix)
                if c.log.diagnostics_every_steps and _is_due(step, c.log.diagnostics_every_steps,
                                                             is_last):
                    diag = jax.device_get(trainer.diagnostics_step(state, batch))
                    writer.scalars(step, diagnostics.per_head_scalars(diag), record=False)
                    diagnostics.write_histograms(writer, step, trainer.model(state), diag)
                stop = False
                if _is_due(step, c.eval.every_steps, is_last):
                    results = trainer.evaluate(state)
                    writer.scalars(step, results)
                    final.update(results)
                    stop = stop_at is not None and results.get("eval/accuracy", 0.0) > stop_at
                preempted = sigterm.requested(step)
                if ckpt.due(step, force=is_last or stop or preempted):
                    writer.flush()     # what a crash loses ends at the checkpoint, in TensorBoard too
                    ckpt.save(step, state, batches.get_state(), force=True)
                if stop:
                    final["train/stopped_early"] = 1.0
                    break
                if preempted and not is_last:
                    raise preemption.Preempted(step, ckpt.directory)
            if step == start:   # resumed at the end: only the final metrics are due
                final.update(trainer.evaluate(state))
                last = next((r for r in reversed(writer.records()) if "train/loss" in r), {})
                last = {k: v for k, v in last.items() if k.startswith("train/")}
        writer.flush()
    finally:
        if progress is not None:
            progress.close()
        ckpt.close()
        writer.close()
    final.update(last)
    final["step"] = step
    writer.final(final)
    return final
