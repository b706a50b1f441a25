"""Causal language models over the mixers of `palimpsa_jax.layers`, their presets, sampling."""
from palimpsa_jax.layers.registry import register_beta_rule, register_mixer
from palimpsa_jax.models.config import MIXER_NAMES, ModelConfig, swiglu_hidden
from palimpsa_jax.models.generate import generate, sample
from palimpsa_jax.models.lm import (
    MIXERS,
    Block,
    CausalLM,
    count_params,
    weight_decay_mask,
)
from palimpsa_jax.models.presets import NOMINAL_SIZES, PRESETS, preset

__all__ = [
    "MIXERS",
    "MIXER_NAMES",
    "NOMINAL_SIZES",
    "PRESETS",
    "Block",
    "CausalLM",
    "ModelConfig",
    "count_params",
    "generate",
    "preset",
    "register_beta_rule",
    "register_mixer",
    "sample",
    "swiglu_hidden",
    "weight_decay_mask",
]
