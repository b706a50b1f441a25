"""Named model configurations: the language models of the paper (170M, 340M, 760M; Llama-2
vocabulary, tied embeddings) and the tiny MQAR models of README "MQAR".

Parameter counts (trainable, embeddings included; `count_params`):

| preset | d_model | layers | heads | count |
|---|---|---|---|---|
| palimpsa_d-170m | 768 | 19 | 16 x 48, expand_v 1, MLP 2048 | 171.9M |
| palimpsa_d-340m | 1024 | 22 | 16 x 64, expand_v 1, MLP 2816 | 340.9M |
| palimpsa_d-760m | 1536 | 23 | 16 x 96, expand_v 1, MLP 4096 | 758.5M |
| gated_deltanet-170m | 768 | 15 | 6 x 128, expand_v 2, MLP 2048 | 166.5M |
| gated_deltanet-340m | 1024 | 18 | 8 x 128, expand_v 2, MLP 2816 | 340.1M |
| gated_deltanet-760m | 1536 | 19 | 12 x 128, expand_v 2, MLP 4096 | 767.7M |
| mamba2-170m | 768 | 38 | 24 x 64, state 128, no MLP | 167.7M |
| mamba2-340m | 1024 | 46 | 32 x 64, state 128, no MLP | 336.4M |
| mamba2-760m | 1536 | 48 | 48 x 64, state 128, no MLP | 752.1M |
| transformer-170m | 768 | 20 | 12 x 64, MLP 2048 | 166.2M |
| transformer-340m | 1024 | 24 | 16 x 64, MLP 2816 | 341.1M |
| transformer-760m | 1536 | 25 | 24 x 64, MLP 4096 | 757.0M |
"""
from __future__ import annotations

from palimpsa_jax.models.config import ModelConfig, swiglu_hidden

LLAMA2_VOCAB = 32000
MQAR_VOCAB = 8192


def _lm(mixer: str, d_model: int, n_layers: int, **fields) -> ModelConfig:
    mlp = {} if mixer == "mamba2" else {"mlp_hidden": swiglu_hidden(d_model)}
    return ModelConfig(vocab_size=LLAMA2_VOCAB, d_model=d_model, n_layers=n_layers,
                       mixers=(mixer,), **mlp, **fields)


def _mqar(mixer: str) -> ModelConfig:
    """d_model 128, 2 layers, no MLP, 8 heads of 16 with Dv = 32 (Mamba2: state 16, heads of 32)."""
    return ModelConfig(vocab_size=MQAR_VOCAB, d_model=128, n_layers=2, mixers=(mixer,),
                       num_heads=8, head_dim=16, expand_v=2, ssm_state=16, ssm_head_dim=32,
                       ssm_expand=2, mlp_hidden=0)


PRESETS: dict[str, ModelConfig] = {
    "palimpsa_d-170m": _lm("palimpsa_d", 768, 19, num_heads=16, head_dim=48),
    "palimpsa_d-340m": _lm("palimpsa_d", 1024, 22, num_heads=16, head_dim=64),
    "palimpsa_d-760m": _lm("palimpsa_d", 1536, 23, num_heads=16, head_dim=96),
    "gated_deltanet-170m": _lm("gated_deltanet", 768, 15, num_heads=6, head_dim=128, expand_v=2),
    "gated_deltanet-340m": _lm("gated_deltanet", 1024, 18, num_heads=8, head_dim=128, expand_v=2),
    "gated_deltanet-760m": _lm("gated_deltanet", 1536, 19, num_heads=12, head_dim=128, expand_v=2),
    "mamba2-170m": _lm("mamba2", 768, 38),
    "mamba2-340m": _lm("mamba2", 1024, 46),
    "mamba2-760m": _lm("mamba2", 1536, 48),
    "transformer-170m": _lm("attention", 768, 20, num_heads=12, head_dim=64),
    "transformer-340m": _lm("attention", 1024, 24, num_heads=16, head_dim=64),
    "transformer-760m": _lm("attention", 1536, 25, num_heads=24, head_dim=64),
    **{f"mqar-{mixer}": _mqar(mixer)
       for mixer in ("palimpsa_d", "palimpsa_m", "gated_deltanet", "mamba2", "attention")},
}

NOMINAL_SIZES = {name: int(name.rsplit("-", 1)[1][:-1]) * 10**6
                 for name in PRESETS if not name.startswith("mqar")}


def preset(name: str, **changes) -> ModelConfig:
    """The named configuration, with optional field changes (validated)."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name].replace(**changes)
