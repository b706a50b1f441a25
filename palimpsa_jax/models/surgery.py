"""Metaplastic surgery (arXiv 2602.09075; ../shared/SPEC.md section 3): a pretrained Mamba2 whose
chosen layers become Palimpsa-M, every backbone weight kept.

Mamba2 is Palimpsa-M without the importance: the same in_proj, conv1d, dt_bias, A_log, D, norm
and out_proj, with q = C, k = B, v = dt x and log_alpha = -A dt. Surgery adds to each chosen
layer a fresh beta projection (W_b1, W_b2, b_scale, `layers.BetaProjection`) and a prior
(Ip_log = 0, I_prior = 1). With beta = 0 the importance stays at the prior, I_t = I_prior = 1,
and the converted layer computes exactly the Mamba2 it came from; fine-tuning then learns
how much evidence each token brings.

The layers to convert are by default those with the weakest forgetting: the largest memory
window N = 1 / (1 - alpha) (`analysis.measures.memory_window`), each layer's median over its
heads and the probe's tokens.
"""
from __future__ import annotations

import json
import pathlib
import re

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from palimpsa_jax.analysis import measures, probe
from palimpsa_jax.models.config import ModelConfig
from palimpsa_jax.models.lm import CausalLM
from palimpsa_jax.models.mamba2_import import ARCHITECTURE, checkpoint_tokenizer, mamba2_model

SOURCE_MIXER, TARGET_MIXER = "mamba2", "palimpsa_m"
RECORD_FILE = "surgery.json"
SELECTION = re.compile(r"weakest:\d+|all|none|\d+(,\d+)*")   # the forms of --layers


def layer_windows(model: CausalLM, rows: dict[str, np.ndarray], *, batch_size: int = 8) -> np.ndarray:
    """The memory window of every layer of `model` on the probe rows (tokens, segment_ids, each
    (R, T); padding where segment_ids == 0 is left out): the median of N = 1 / (1 - alpha) over
    the layer's heads and the rows' tokens, float64 (n_layers,); nan for a layer without a
    recurrent memory (attention)."""
    windows: dict[int, list[np.ndarray]] = {}
    for start in range(0, len(rows["tokens"]), batch_size):
        tokens = rows["tokens"][start:start + batch_size]
        segment_ids = rows["segment_ids"][start:start + batch_size]
        real = np.asarray(segment_ids) > 0
        for layer, inputs in probe(model, jnp.asarray(tokens), jnp.asarray(segment_ids)).layers.items():
            window = np.asarray(measures.memory_window(inputs["log_alpha"]))      # (B, T, H)
            windows.setdefault(layer, []).append(window[real].ravel())
    return np.array([np.median(np.concatenate(windows[layer])) if layer in windows else np.nan
                     for layer in range(model.config.n_layers)])


def choose_layers(selection: str, windows: np.ndarray, mixers: tuple[str, ...]) -> tuple[int, ...]:
    """The layers `selection` names, ascending: "weakest:K" (the K Mamba2 layers with the largest
    windows, ties to the lower index), "all" (every Mamba2 layer), "none", or explicit indices
    "0,5,7" (each a Mamba2 layer). ValueError naming `layers` otherwise."""
    convertible = [i for i, mixer in enumerate(mixers) if mixer == SOURCE_MIXER]
    if selection == "all":
        return tuple(convertible)
    if selection == "none":
        return ()
    weakest = re.fullmatch(r"weakest:(\d+)", selection)
    if weakest:
        count = int(weakest[1])
        if not 1 <= count <= len(convertible):
            raise ValueError(f"layers: weakest:{count} needs 1 to {len(convertible)} (the model's "
                             f"{SOURCE_MIXER} layers), got {count}")
        by_window = sorted(convertible, key=lambda i: (-windows[i], i))
        return tuple(sorted(by_window[:count]))
    check_selection(selection)
    chosen = sorted({int(i) for i in selection.split(",")})
    wrong = [i for i in chosen if i >= len(mixers) or mixers[i] != SOURCE_MIXER]
    if wrong:
        raise ValueError(f"layers: {wrong} are not {SOURCE_MIXER} layers of this model "
                         f"(layers {convertible} are, of {len(mixers)})")
    return tuple(chosen)


def check_selection(selection: str) -> None:
    """ValueError naming `layers` unless selection has one of the forms of `choose_layers`."""
    if not SELECTION.fullmatch(selection):
        raise ValueError(f"layers must be weakest:K, all, none or comma-separated layer indices, "
                         f"got {selection!r}")


def converted_config(source: ModelConfig, layers: tuple[int, ...], **memory) -> ModelConfig:
    """source with `layers` switched to palimpsa_m (mixers listed per layer) and `memory` the
    fields that are not the checkpoint's (beta_rank, prior_family, learn_prior, beta_rule,
    backend, chunk_size, dtype, init), of which metaplasticity must be True. A source whose
    ModelConfig.metaplasticity is False converts only if no other layer reads that flag (Palimpsa
    layers without metaplasticity would turn metaplastic with it)."""
    fixed = sorted(set(memory) & set(ARCHITECTURE))
    if fixed:
        raise ValueError(f"model: {fixed} are fixed by the source model")
    if memory.get("metaplasticity", True) is not True:
        raise ValueError("model.metaplasticity must be True: surgery makes layers metaplastic")
    flagged = sorted({"palimpsa_d", TARGET_MIXER} & set(source.layer_mixers))
    if layers and not source.metaplasticity and flagged:
        raise ValueError(f"the source model has metaplasticity=False and {flagged} layers, which would "
                         f"become metaplastic too: convert a model without them")
    mixers = tuple(TARGET_MIXER if i in layers else mixer for i, mixer in enumerate(source.layer_mixers))
    if layers:
        memory = {**memory, "metaplasticity": True}
    return source.replace(mixers=mixers, **memory)


def convert(source: CausalLM, config: ModelConfig, *, seed: int) -> CausalLM:
    """The CausalLM of `config` (`converted_config` of source's) with every parameter of source
    (bitwise) and fresh beta projections and priors (from `seed`, as a new run of `config`
    would draw them)."""
    model = CausalLM(config, rngs=nnx.Rngs(seed))
    fresh = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    kept = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    for path, variable in kept.items():
        if path not in fresh or fresh[path].shape != variable.shape:
            raise ValueError(f"source parameter {'.'.join(map(str, path))} {variable.shape} has no place "
                             f"in the converted model")
        fresh[path] = fresh[path].replace(variable.get_value())
    nnx.update(model, nnx.from_flat_state(fresh))
    return model


def probe_rows(path, *, eos_id: int, seq_len: int, rows: int) -> dict[str, np.ndarray]:
    """The first `rows` packed rows (tokens, segment_ids) of the corpus `path` (a file, glob or
    list), as training reads them (`data.text.PackedRows`)."""
    from palimpsa_jax.data.text import PackedRows

    packed = PackedRows(path, eos_id, seq_len)
    if rows < 1 or len(packed) < rows:
        raise ValueError(f"probe_rows: the probe corpus holds {len(packed)} rows of {seq_len} tokens, "
                         f"asked for {rows}")
    items = [packed[i] for i in range(rows)]
    return {name: np.stack([item[name] for item in items]) for name in ("tokens", "segment_ids")}


def source_model(source, experiment: ml_collections.ConfigDict) -> tuple[CausalLM, object]:
    """(model, tokenizer or None) of `source`: a run directory (its latest checkpoint and
    tokenizer) or a pretrained Mamba2 directory (`models.mamba2_import`, in the experiment's
    backend, chunk size and dtype)."""
    source = pathlib.Path(source)
    if (source / "checkpoints").is_dir():
        from palimpsa_jax.analysis.run import load_run
        from palimpsa_jax.data.tokenizer import run_tokenizer

        model = load_run(source).model
        try:
            tokenizer = run_tokenizer(source)
        except FileNotFoundError:
            tokenizer = None
        return model, tokenizer
    run = {k: experiment.model[k] for k in ("backend", "chunk_size", "dtype") if k in experiment.model}
    return mamba2_model(source, **run), checkpoint_tokenizer(source)


def metaplastic_surgery(source, workdir, experiment: ml_collections.ConfigDict, *, layers: str,
                        probe_path, probe_count: int = 8, tokenizer=None) -> dict:
    """Converts the model in `source` (a run or a pretrained Mamba2 directory) and writes it as a
    run at step 0 in workdir (`training.warm_start`), fine-tuned by `palimpsa-train --resume`.

    experiment: the fine-tuning config (experiments/surgery/mamba2.py); its model's fields that
    the checkpoint does not fix (beta_rank, prior_family, learn_prior, backend, dtype, ...) are
    the converted layers'. layers: `choose_layers`. The windows are measured on `probe_count`
    rows of data.seq_len tokens of the corpus `probe_path`. Returns the record written to
    workdir/surgery.json: source, probe, windows per layer, selection, the converted layers.
    """
    from palimpsa_jax.data.tokenizer import Tokenizer
    from palimpsa_jax.training import model_fields
    from palimpsa_jax.training.warm_start import write_warm_start

    workdir = pathlib.Path(workdir)
    if (workdir / "config.json").exists():
        raise FileExistsError(f"workdir {workdir} already holds a run (config.json)")
    check_selection(layers)                    # before the source is read
    model, found = source_model(source, experiment)
    tokenizer = found if tokenizer is None else Tokenizer(tokenizer, eos_id=experiment.data.eos_id)
    eos_id = experiment.data.eos_id if tokenizer is None else tokenizer.eos_id
    rows = probe_rows(probe_path, eos_id=eos_id, seq_len=experiment.data.seq_len, rows=probe_count)
    windows = layer_windows(model, rows)
    chosen = choose_layers(layers, windows, model.config.layer_mixers)
    memory = {k: v for k, v in experiment.model.to_dict().items() if k not in ARCHITECTURE}
    config = converted_config(model.config, chosen, **memory)
    converted = convert(model, config, seed=experiment.seed)
    c = ml_collections.ConfigDict(experiment.to_dict())
    c.model = model_fields(config)
    write_warm_start(workdir, c, converted, tokenizer=tokenizer)
    record = {"source": str(source), "probe": str(probe_path), "probe_rows": probe_count,
              "seq_len": experiment.data.seq_len, "selection": layers, "layers": list(chosen),
              "windows": [None if np.isnan(w) else float(w) for w in windows],
              "mixers": list(config.layer_mixers)}
    (workdir / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record
