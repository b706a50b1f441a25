"""Pretrained Mamba2 language models in and out: the checkpoints of mamba_ssm (state-spaces) and
of transformers' Mamba2ForCausalLM, read into our `CausalLM` of "mamba2" layers, and ours written
back in transformers' layout.

Our Mamba2 block is the reference one up to transposes (`layers.Mamba2`): x + mixer(RMSNorm(x)),
no MLP, final RMSNorm, tied or untied head. Checkpoint weight -> our parameter:

| mamba_ssm / transformers | ours | transform |
|---|---|---|
| backbone.embedding.weight / backbone.embeddings.weight (V, D) | embed.embedding (V, D) | |
| backbone.layers.N.norm.weight (D,) | blocks.N.mixer_norm.scale | |
| backbone.layers.N.mixer.in_proj.weight (P, D), .bias | blocks.N.mixer.in_proj.kernel (D, P), .bias | transpose |
| backbone.layers.N.mixer.conv1d.weight (C, 1, W), .bias | blocks.N.mixer.conv1d.weight (W, C), .bias | [:, 0].T |
| backbone.layers.N.mixer.{dt_bias, A_log, D} (H,) | blocks.N.mixer.{dt_bias, A_log, D} | |
| backbone.layers.N.mixer.norm.weight (d_inner,) | blocks.N.mixer.norm.scale | |
| backbone.layers.N.mixer.out_proj.weight (D, d_inner), .bias | blocks.N.mixer.out_proj.kernel, .bias | transpose |
| backbone.norm_f.weight (D,) | norm.scale | |
| lm_head.weight (V, D) | head.kernel (D, V) (absent when tied) | transpose |

The vocabulary is the embedding's rows: mamba_ssm pads vocab_size up to a multiple of
pad_vocab_size_multiple, transformers stores it as is.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from palimpsa_jax.models.config import ModelConfig
from palimpsa_jax.models.lm import CausalLM

# The ModelConfig fields a checkpoint fixes; the others (backend, chunk_size, dtype, init) are the run's.
ARCHITECTURE = ("vocab_size", "d_model", "n_layers", "mixers", "ssm_state", "ssm_groups", "ssm_expand",
                "ssm_head_dim", "ssm_bias", "ssm_conv_bias", "conv_size", "mlp_hidden", "tie_embeddings",
                "final_norm", "norm_eps")
SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
# mamba_ssm's Mamba2 defaults (mamba_ssm.modules.mamba2.Mamba2, MambaConfig).
_SSM_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "bias": False,
                 "conv_bias": True, "rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False,
                 "dt_limit": (0.0, math.inf), "activation": "silu", "d_ssm": None}


class CheckpointFormatError(ValueError):
    """A pretrained checkpoint that is not a Mamba2 language model we can read or write; the
    message names the file, the config field or the weight."""


# --- config ------------------------------------------------------------------------------

def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a pretrained Mamba2 directory")
    return json.loads(path.read_text())


def checkpoint_layout(raw: dict, source: str = "config.json") -> str:
    """"mamba_ssm" (d_model, n_layer, ssm_cfg) or "transformers" (model_type "mamba2") of a config.json."""
    if raw.get("model_type") == "mamba2" or "hidden_size" in raw and "state_size" in raw:
        return "transformers"
    if "d_model" in raw and "n_layer" in raw:
        return "mamba_ssm"
    raise CheckpointFormatError(f"{source}: neither a mamba_ssm config (d_model, n_layer, ssm_cfg) nor a "
                                f"transformers Mamba2Config (model_type 'mamba2'); model_type "
                                f"{raw.get('model_type')!r}, keys {sorted(raw)}")


def _number(value):
    """A JSON number, or transformers' {"__float__": "Infinity"} for the non-finite ones."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else value


def _require(source: str, field: str, value, wanted) -> None:
    same = tuple(map(_number, value)) == wanted if isinstance(wanted, tuple) else value == wanted
    if not same:
        raise CheckpointFormatError(f"{source}: {field} = {value!r} is not supported (our Mamba2 has {wanted!r})")


def _transformers_fields(raw: dict, source: str) -> dict:
    for field, wanted in (("hidden_act", "silu"), ("time_step_limit", (0.0, math.inf))):
        if field in raw:
            _require(source, field, raw[field], wanted)
    d_model, expand, head_dim = raw["hidden_size"], raw.get("expand", 2), raw.get("head_dim", 64)
    if "num_heads" in raw and raw["num_heads"] * head_dim != expand * d_model:
        raise CheckpointFormatError(f"{source}: num_heads x head_dim ({raw['num_heads']} x {head_dim}) must "
                                    f"equal expand x hidden_size ({expand} x {d_model})")
    return dict(vocab_size=raw["vocab_size"], d_model=d_model, n_layers=raw["num_hidden_layers"],
                ssm_state=raw.get("state_size", 128), ssm_groups=raw.get("n_groups", 8), ssm_expand=expand,
                ssm_head_dim=head_dim, ssm_bias=raw.get("use_bias", False),
                ssm_conv_bias=raw.get("use_conv_bias", True), conv_size=raw.get("conv_kernel", 4),
                norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=raw.get("tie_word_embeddings", False))


def _mamba_ssm_fields(raw: dict, source: str) -> dict:
    _require(source, "d_intermediate (an MLP in every block)", raw.get("d_intermediate", 0), 0)
    _require(source, "attn_layer_idx (attention layers)", list(raw.get("attn_layer_idx", [])), [])
    _require(source, "rms_norm (LayerNorm blocks)", raw.get("rms_norm", True), True)
    # mamba_ssm's gated norm has eps 1e-5 whatever the blocks' norm_epsilon; ours one norm_eps.
    _require(source, "norm_epsilon", raw.get("norm_epsilon", 1e-5), 1e-5)
    ssm = {**_SSM_DEFAULTS, **raw.get("ssm_cfg", {})}
    _require(source, "ssm_cfg.layer", ssm.get("layer", "Mamba1"), "Mamba2")
    for field in ("rmsnorm", "norm_before_gate", "D_has_hdim", "dt_limit", "activation"):
        _require(source, f"ssm_cfg.{field}", ssm[field], _SSM_DEFAULTS[field])
    d_inner = ssm["expand"] * raw["d_model"]
    if ssm["d_ssm"] not in (None, d_inner):
        _require(source, "ssm_cfg.d_ssm", ssm["d_ssm"], d_inner)
    multiple = raw.get("pad_vocab_size_multiple", 8)
    return dict(vocab_size=multiple * math.ceil(raw["vocab_size"] / multiple), d_model=raw["d_model"],
                n_layers=raw["n_layer"], ssm_state=ssm["d_state"], ssm_groups=ssm["ngroups"],
                ssm_expand=ssm["expand"], ssm_head_dim=ssm["headdim"], ssm_bias=ssm["bias"],
                ssm_conv_bias=ssm["conv_bias"], conv_size=ssm["d_conv"], norm_eps=1e-5,
                tie_embeddings=raw.get("tie_embeddings", True))


def mamba2_config(directory: str | os.PathLike, **changes) -> ModelConfig:
    """The ModelConfig of the pretrained Mamba2 in directory (its config.json, either layout), with
    `changes` to the fields it does not fix (backend, chunk_size, dtype; not ARCHITECTURE)."""
    path = pathlib.Path(directory) / "config.json"
    raw = _read_json(path)
    fixed = sorted(set(changes) & set(ARCHITECTURE))
    if fixed:
        raise ValueError(f"changes: {fixed} are fixed by the checkpoint {path}")
    read = _transformers_fields if checkpoint_layout(raw, str(path)) == "transformers" else _mamba_ssm_fields
    try:
        fields = read(raw, str(path))
    except KeyError as e:
        raise CheckpointFormatError(f"{path}: missing field {e.args[0]!r}") from None
    return ModelConfig(mixers=("mamba2",), mlp_hidden=0, final_norm="rmsnorm", **fields, **changes)


# --- weights -----------------------------------------------------------------------------

def read_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Checkpoint name -> float32 array, from model.safetensors, its shards (with
    model.safetensors.index.json) or pytorch_model.bin (read with torch, imported only then)."""
    directory = pathlib.Path(directory)
    if (directory / SAFETENSORS_INDEX).is_file():
        shards = sorted(set(_read_json(directory / SAFETENSORS_INDEX)["weight_map"].values()))
        files = [directory / shard for shard in shards]
    elif (directory / SAFETENSORS).is_file():
        files = [directory / SAFETENSORS]
    elif (directory / TORCH_BIN).is_file():
        import torch

        state = torch.load(directory / TORCH_BIN, map_location="cpu", weights_only=True)
        return {name: tensor.float().numpy() for name, tensor in state.items()}
    else:
        raise FileNotFoundError(f"{directory} holds no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN})")
    from safetensors import safe_open

    weights = {}
    for file in files:
        with safe_open(file, framework="flax") as f:   # jax arrays: bfloat16 too
            weights.update({name: np.asarray(f.get_tensor(name), np.float32) for name in f.keys()})
    return weights


def _names(config: ModelConfig, layout: str) -> dict[str, tuple[tuple, str]]:
    """Checkpoint name -> (our parameter's path, transform: "", "T" (transpose) or "conv")."""
    embedding = "backbone.embeddings.weight" if layout == "transformers" else "backbone.embedding.weight"
    names = {embedding: (("embed", "embedding"), ""), "backbone.norm_f.weight": (("norm", "scale"), "")}
    if not config.tie_embeddings:
        names["lm_head.weight"] = (("head", "kernel"), "T")
    mixer = {"in_proj.weight": (("in_proj", "kernel"), "T"), "conv1d.weight": (("conv1d", "weight"), "conv"),
             "dt_bias": (("dt_bias",), ""), "A_log": (("A_log",), ""), "D": (("D",), ""),
             "norm.weight": (("norm", "scale"), ""), "out_proj.weight": (("out_proj", "kernel"), "T")}
    if config.ssm_bias:
        mixer.update({"in_proj.bias": (("in_proj", "bias"), ""), "out_proj.bias": (("out_proj", "bias"), "")})
    if config.ssm_conv_bias:
        mixer["conv1d.bias"] = (("conv1d", "bias"), "")
    for n in range(config.n_layers):
        names[f"backbone.layers.{n}.norm.weight"] = (("blocks", n, "mixer_norm", "scale"), "")
        names.update({f"backbone.layers.{n}.mixer.{name}": (("blocks", n, "mixer", *path), how)
                      for name, (path, how) in mixer.items()})
    return names


def _to_ours(array: np.ndarray, how: str) -> np.ndarray:
    return array.T if how == "T" else array[:, 0, :].T if how == "conv" else array


def _to_theirs(array: np.ndarray, how: str) -> np.ndarray:
    return array.T if how == "T" else array.T[:, None, :] if how == "conv" else array


def abstract_params(config: ModelConfig) -> nnx.State:
    """nnx.state(CausalLM(config), nnx.Param) as shapes (nothing is allocated)."""
    return nnx.state(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))), nnx.Param)


def load_mamba2(directory: str | os.PathLike, **changes) -> tuple[ModelConfig, nnx.State]:
    """(config, params) of the pretrained Mamba2 in directory: params is the float32
    nnx.State of Params of `CausalLM(config)` (`nnx.update(model, params)`). changes: as
    `mamba2_config`. Every weight must be there with its shape, and no other one
    (a tied head's lm_head.weight may be, equal to the embedding)."""
    directory = pathlib.Path(directory)
    config = mamba2_config(directory, **changes)
    layout = checkpoint_layout(_read_json(directory / "config.json"))
    weights = read_weights(directory)
    names = _names(config, layout)
    embedding = next(name for name in names if "embedding" in name)
    if config.tie_embeddings and "lm_head.weight" in weights:
        if not (embedding in weights and np.array_equal(weights["lm_head.weight"], weights[embedding])):
            raise CheckpointFormatError(f"{directory}: the config ties the embeddings but lm_head.weight differs "
                                        f"from {embedding}")
        weights = {name: w for name, w in weights.items() if name != "lm_head.weight"}
    missing, unexpected = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
    if missing or unexpected:
        raise CheckpointFormatError(f"{directory} ({layout} layout): missing weights {missing}, unexpected "
                                    f"weights {unexpected}")
    config = config.replace(vocab_size=weights[embedding].shape[0])   # the vocabulary is the embedding's rows
    params = abstract_params(config)
    flat = dict(nnx.to_flat_state(params))
    for name, (path, how) in names.items():
        value = _to_ours(weights[name], how)
        if value.shape != flat[path].shape:
            raise CheckpointFormatError(f"{directory}: weight {name} has shape {weights[name].shape}, "
                                        f"expected {_to_theirs(np.zeros(flat[path].shape), how).shape}")
        flat[path] = flat[path].replace(jnp.asarray(value, jnp.float32))
    return config, nnx.from_flat_state(flat)


def mamba2_model(directory: str | os.PathLike, **changes) -> CausalLM:
    """The CausalLM of `load_mamba2(directory, **changes)`."""
    config, params = load_mamba2(directory, **changes)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    nnx.update(model, params)
    return model


# --- a run directory ---------------------------------------------------------------------

def _eos_id(directory: pathlib.Path) -> int | None:
    """The end-of-document id a transformers config.json names (None: let the tokenizer say)."""
    eos = _read_json(directory / "config.json").get("eos_token_id")
    return eos if isinstance(eos, int) else None


def import_mamba2(directory: str | os.PathLike, workdir: str | os.PathLike,
                  experiment: ml_collections.ConfigDict, *, tokenizer: str | os.PathLike | None = None
                  ) -> pathlib.Path:
    """Writes the pretrained Mamba2 in directory as a run at step 0 in workdir; returns workdir.

    experiment: the run's config (e.g. experiments/lm/palimpsa_d.py's, with data.path set: every
    run needs its corpus); its model's ARCHITECTURE fields become the checkpoint's, the others
    (backend, chunk_size, dtype) stay. The run is `training.warm_start.write_warm_start`'s, with
    the tokenizer `tokenizer`, else directory/tokenizer.json or tokenizer.model, if any.
    """
    from palimpsa_jax.training import model_fields
    from palimpsa_jax.training.warm_start import write_warm_start

    directory, workdir = pathlib.Path(directory), pathlib.Path(workdir)
    if (workdir / "config.json").exists():
        raise FileExistsError(f"workdir {workdir} already holds a run (config.json)")
    run_model = {k: v for k, v in experiment.model.to_dict().items() if k not in ARCHITECTURE}
    config, params = load_mamba2(directory, **run_model)
    c = ml_collections.ConfigDict(experiment.to_dict())
    c.model = model_fields(config)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    nnx.update(model, params)
    return write_warm_start(workdir, c, model, tokenizer=checkpoint_tokenizer(directory, tokenizer))


def checkpoint_tokenizer(directory: str | os.PathLike, tokenizer: str | os.PathLike | None = None):
    """The `data.Tokenizer` of `tokenizer`, else of directory/tokenizer.json or tokenizer.model
    (with the end-of-document id the transformers config.json names), or None if there is none."""
    from palimpsa_jax.data.tokenizer import FILE_NAMES, Tokenizer

    directory = pathlib.Path(directory)
    if tokenizer is None:
        tokenizer = next((directory / name for name in FILE_NAMES.values() if (directory / name).is_file()), None)
    return None if tokenizer is None else Tokenizer(tokenizer, eos_id=_eos_id(directory))


# --- out ---------------------------------------------------------------------------------

def transformers_config(config: ModelConfig, **fields) -> dict:
    """The config.json of transformers' Mamba2ForCausalLM for a ModelConfig of mamba2 layers (its
    chunk_size ours when set, so that both sum in the same order)."""
    if set(config.layer_mixers) != {"mamba2"} or config.mlp_hidden or config.final_norm != "rmsnorm":
        raise CheckpointFormatError(f"config: only models of mamba2 layers without MLP and with a final RMSNorm "
                                    f"export to Mamba2ForCausalLM, got mixers {config.mixers}, mlp_hidden "
                                    f"{config.mlp_hidden}, final_norm {config.final_norm!r}")
    return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "vocab_size": config.vocab_size,
            "hidden_size": config.d_model, "num_hidden_layers": config.n_layers, "state_size": config.ssm_state,
            "n_groups": config.ssm_groups, "expand": config.ssm_expand, "head_dim": config.ssm_head_dim,
            "num_heads": config.ssm_expand * config.d_model // config.ssm_head_dim,
            "conv_kernel": config.conv_size, "use_bias": config.ssm_bias, "use_conv_bias": config.ssm_conv_bias,
            "layer_norm_epsilon": config.norm_eps, "hidden_act": "silu", "residual_in_fp32": True,
            "tie_word_embeddings": config.tie_embeddings, "dtype": "float32",
            **({} if config.chunk_size is None else {"chunk_size": config.chunk_size}), **fields}


def export_mamba2(model_or_workdir: CausalLM | str | os.PathLike, directory: str | os.PathLike) -> pathlib.Path:
    """Writes a CausalLM of mamba2 layers (or the latest checkpoint of a run's workdir, with its
    tokenizer and eos id) as transformers' Mamba2ForCausalLM: directory/config.json and
    model.safetensors (float32). Returns directory."""
    from safetensors.numpy import save_file

    directory, fields, tokenizer = pathlib.Path(directory), {}, None
    if isinstance(model_or_workdir, CausalLM):
        model = model_or_workdir
    else:
        from palimpsa_jax.analysis.run import load_run
        from palimpsa_jax.data.tokenizer import run_tokenizer

        model = load_run(model_or_workdir).model
        try:
            tokenizer = run_tokenizer(model_or_workdir)
            fields["eos_token_id"] = tokenizer.eos_id
        except FileNotFoundError:
            pass
    config = model.config
    hf_config = transformers_config(config, **fields)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    weights = {name: np.ascontiguousarray(_to_theirs(np.asarray(flat[path][...], np.float32), how))
               for name, (path, how) in _names(config, "transformers").items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(weights, directory / SAFETENSORS, metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory
