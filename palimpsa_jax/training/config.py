"""The experiment configuration: one ml_collections ConfigDict per run, its defaults and checks.

Sections (every key is documented in `base_config`): model (the fields of `ModelConfig`), data,
batch_size, train, optim, mesh, sharding, checkpoint, log, eval. Experiment files
(`experiments/**.py`) start from `base_config()` and set every value that differs; the library
holds only defaults and checks. `check_config` validates a config before anything is compiled,
raising `ConfigError` (a ValueError) whose message names the key.
"""
from __future__ import annotations

import dataclasses
import math
import typing

import ml_collections

from palimpsa_jax import sharding
from palimpsa_jax.models import ModelConfig

SCHEDULES = ("cosine", "linear", "constant")
DATA_KINDS = ("mqar", "text")


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key. The command line reports it
    in one line."""


def model_fields(config: ModelConfig) -> ml_collections.ConfigDict:
    """The fields of a ModelConfig as a ConfigDict (so each can be overridden; an optional
    field that is None becomes a typed placeholder, e.g. `--config.model.chunk_size=16`)."""
    hints = typing.get_type_hints(ModelConfig)
    fields = {}
    for name, value in dataclasses.asdict(config).items():
        if value is None:
            (field_type,) = [t for t in typing.get_args(hints[name]) if t is not type(None)]
            value = ml_collections.FieldReference(None, field_type=field_type)
        fields[name] = value
    return ml_collections.ConfigDict(fields)


def base_config() -> ml_collections.ConfigDict:
    """Every key with its default. `model` and `data` are filled in by the experiment."""
    c = ml_collections.ConfigDict()
    c.seed = 0                       # parameter initialisation and training data order
    c.model = ml_collections.ConfigDict()
    c.data = ml_collections.ConfigDict()
    c.batch_size = 32                # global batch (sequences per optimiser step)
    c.train = ml_collections.ConfigDict(dict(
        steps=1000,                  # optimiser steps
        grad_accum=1,                # micro-batches per step (batch_size / grad_accum each)
        early_stop_accuracy=ml_collections.FieldReference(None, field_type=float),
                                     # stop after an evaluation with eval/accuracy above this
    ))
    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-3,                     # peak learning rate
        metaplastic_lr=ml_collections.FieldReference(None, field_type=float),
                                     # peak LR of W_b1, W_b2, b_scale, Ip_log (None: lr)
        warmup_steps=100,
        schedule="cosine",           # after warmup: cosine | linear (to min_lr_ratio lr) | constant
        schedule_every_steps=1,      # the LR changes every this many steps (e.g. once an epoch)
        min_lr_ratio=0.0,
        b1=0.9, b2=0.95, eps=1e-8,
        weight_decay=0.1,            # AdamW, not on norms, biases, A_log, dt_bias, D, b_scale, Ip_log
        decay_every_parameter=False, # True: weight decay on every parameter (PyTorch's AdamW)
        clip_norm=1.0,               # global gradient norm clipping (0: off)
    ))
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))   # -1: remaining devices
    c.sharding = ml_collections.ConfigDict(dict(rules=[list(r) for r in sharding.DEFAULT_RULES]))
    c.checkpoint = ml_collections.ConfigDict(dict(
        every_steps=200,             # also at the last step
        keep=3,                      # checkpoints kept
        async_save=True,
    ))
    c.log = ml_collections.ConfigDict(dict(
        every_steps=10,              # TensorBoard scalars and metrics.jsonl
        diagnostics_every_steps=100, # metaplasticity diagnostics (0: off)
        progress=True,               # tqdm progress bar
        peak_flops=ml_collections.FieldReference(None, field_type=float),
                                     # dense bf16 peak FLOP/s of one device for train/mfu (None:
                                     # by device kind, models.flops.PEAK_FLOPS; unknown: no MFU)
    ))
    c.eval = ml_collections.ConfigDict(dict(
        every_steps=200,             # also at the last step (0: only at the end)
        batch_size=64,
    ))
    return c


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"optim.lr": 0.001, ...} from a nested dict (a config's JSON)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(saved: dict, now: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys whose values differ between two configs' JSON dicts, except the keys
    under `allowed` (a key or a section, e.g. "train.steps" or "log")."""
    saved, now = flatten(saved), flatten(now)
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k)
                  and not any(k == a or k.startswith(a + ".") for a in allowed))


def _positive_int(c, key: str, allow_zero: bool = False) -> None:
    value = _get(c, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        raise ValueError(f"{key} must be a {'non-negative' if allow_zero else 'positive'} "
                         f"integer, got {value!r}")


def _get(c, key: str):
    for part in key.split("."):
        c = c[part]
    return c


def check_config(c: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> ModelConfig:
    """Validates the whole config against a mesh of `mesh_shape` (axis -> size) before anything
    is built, and returns the ModelConfig. Raises ConfigError naming the offending key."""
    try:
        return _check_config(c, mesh_shape)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_config(c, mesh_shape: dict[str, int]) -> ModelConfig:
    try:
        model = ModelConfig(**c.model.to_dict())
    except (TypeError, ValueError) as e:
        raise ValueError(f"model: {e}") from None
    for key in ("batch_size", "train.steps", "train.grad_accum", "checkpoint.keep",
                "eval.batch_size", "log.every_steps"):
        _positive_int(c, key)
    for key in ("optim.warmup_steps", "checkpoint.every_steps", "log.diagnostics_every_steps",
                "eval.every_steps"):
        _positive_int(c, key, allow_zero=True)
    _positive_int(c, "optim.schedule_every_steps")
    if c.optim.warmup_steps > c.train.steps:
        raise ValueError(f"optim.warmup_steps ({c.optim.warmup_steps}) must not exceed "
                         f"train.steps ({c.train.steps})")
    peak = c.log.get("peak_flops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                             or not 0 < peak < math.inf):
        raise ValueError(f"log.peak_flops must be a positive number of FLOP/s per device or "
                         f"None (by device kind), got {peak!r}")
    stop_at = c.train.early_stop_accuracy
    if stop_at is not None and not 0 < stop_at <= 1:
        raise ValueError(f"train.early_stop_accuracy must be in (0, 1] or None, got {stop_at!r}")
    o = c.optim
    if not o.lr > 0:
        raise ValueError(f"optim.lr must be > 0, got {o.lr!r}")
    if o.metaplastic_lr is not None and not o.metaplastic_lr > 0:
        raise ValueError(f"optim.metaplastic_lr must be > 0 or None, got {o.metaplastic_lr!r}")
    if o.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {o.schedule!r}")
    for key, low, high in (("min_lr_ratio", 0, 1), ("b1", 0, 1), ("b2", 0, 1)):
        if not low <= o[key] <= high:
            raise ValueError(f"optim.{key} must be in [{low}, {high}], got {o[key]!r}")
    for key in ("eps", "weight_decay", "clip_norm"):
        if not o[key] >= 0:
            raise ValueError(f"optim.{key} must be >= 0, got {o[key]!r}")
    mesh = {axis: mesh_shape.get(axis, 1) for axis in sharding.MESH_AXES}
    batch_devices = mesh["data"] * mesh["fsdp"]
    if c.batch_size % (batch_devices * c.train.grad_accum):
        raise ValueError(f"batch_size ({c.batch_size}) must be divisible by mesh.data x mesh.fsdp "
                         f"x train.grad_accum ({mesh['data']} x {mesh['fsdp']} x "
                         f"{c.train.grad_accum})")
    if c.eval.batch_size % batch_devices:
        raise ValueError(f"eval.batch_size ({c.eval.batch_size}) must be divisible by mesh.data x "
                         f"mesh.fsdp ({batch_devices})")
    rules = [tuple(r) for r in c.sharding.rules]
    sharding.check_rules(rules, tuple(mesh))
    _check_heads(model, mesh, rules)
    _check_data(c.data, model)
    return model


def _check_heads(model: ModelConfig, mesh, rules) -> None:
    """The kernels run per shard of heads: every mixer's head count must divide evenly."""
    axes = sharding.logical_spec(("heads",), rules)[0]
    size = sharding.axis_size(mesh, axes)
    heads = {"model.num_heads": model.num_heads}
    if {"mamba2", "palimpsa_m"} & set(model.mixers):
        heads["model.ssm_expand x d_model / ssm_head_dim"] = (model.ssm_expand * model.d_model
                                                             // model.ssm_head_dim)
    for key, count in heads.items():
        if count % size:
            raise ValueError(f"{key} ({count}) must be divisible by the mesh axes of 'heads' "
                             f"({axes}: {size} devices)")


def _check_data(d, model: ModelConfig) -> None:
    if d.get("kind") not in DATA_KINDS:
        raise ValueError(f"data.kind must be one of {DATA_KINDS}, got {d.get('kind')!r}")
    if d.get("vocab_size", model.vocab_size) != model.vocab_size:
        raise ValueError(f"data.vocab_size ({d.vocab_size}) must equal model.vocab_size "
                         f"({model.vocab_size})")
    if d.kind == "text" and not d.get("path"):
        raise ValueError("data.path must name the training corpus (a .npy file of token ids or a "
                         "glob of shards; see palimpsa-prepare and palimpsa_jax.data.write_corpus)")
    if d.kind == "text":
        from palimpsa_jax.data.text import corpus_files

        for key in ("path", "test_path"):
            if d.get(key):
                corpus_files(d[key], name=f"data.{key}")   # a glob must match a file
    if d.kind == "text" and d.get("tokenizer"):
        from palimpsa_jax.data.tokenizer import Tokenizer

        try:
            tokenizer = Tokenizer(d.tokenizer, eos_id=d.eos_id)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer: {e}") from None
        if tokenizer.vocab_size > model.vocab_size:
            raise ValueError(f"data.tokenizer has {tokenizer.vocab_size} ids, more than "
                             f"model.vocab_size ({model.vocab_size})")
    seq_len = d.get("seq_len")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"data.seq_len must be a positive integer, got {seq_len!r}")
