"""Token mixers (Flax NNX) and their shared pieces.

Every mixer maps (B, T, d_model) -> (B, T, d_model) with one call signature,
`y, cache = mixer(x, segment_ids=None, cache=None)`, and `mixer.init_cache(batch, max_length,
dtype)`: without a cache the call is a full-sequence forward (cache None returned); with one it
continues from it, for a prefill of any length or single-token decoding.
"""
from palimpsa_jax.layers.attention import Attention, KVCache
from palimpsa_jax.layers.common import (
    GatedRMSNorm,
    LayerNorm,
    RecurrentCache,
    RMSNorm,
    ShortConv,
    SwiGLU,
    rope,
    segments,
)
from palimpsa_jax.layers.delta import GatedDeltaNet, PalimpsaD, QKVMixer
from palimpsa_jax.layers.init import Init
from palimpsa_jax.layers.mamba2 import Mamba2, PalimpsaM
from palimpsa_jax.layers.memory import (
    BetaProjection,
    DeltaMemory,
    LinearMemory,
    Memory,
    PalimpsaMemory,
    Prior,
)
from palimpsa_jax.layers.registry import register_beta_rule, register_mixer
from palimpsa_jax.layers.rule_mixer import RuleMemory, RuleMixer

__all__ = [
    "Attention",
    "BetaProjection",
    "DeltaMemory",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "Init",
    "KVCache",
    "LayerNorm",
    "LinearMemory",
    "Mamba2",
    "Memory",
    "PalimpsaD",
    "PalimpsaM",
    "PalimpsaMemory",
    "Prior",
    "QKVMixer",
    "RMSNorm",
    "RecurrentCache",
    "RuleMemory",
    "RuleMixer",
    "ShortConv",
    "SwiGLU",
    "register_beta_rule",
    "register_mixer",
    "rope",
    "segments",
]
