"""Token mixers (Flax NNX) and their shared pieces.

Every mixer maps (B, T, d_model) -> (B, T, d_model) with one call signature,
`y, cache = mixer(x, segment_ids=None, cache=None)`, and `mixer.init_cache(batch, max_length,
dtype)`: without a cache the call is a full-sequence forward (cache None returned); with one it
continues from it, for a prefill of any length or single-token decoding.
"""
from palimpsa_jax.layers.attention import Attention, KVCache
from palimpsa_jax.layers.common import (
    GatedRMSNorm,
    RecurrentCache,
    RMSNorm,
    ShortConv,
    SwiGLU,
    rope,
    segments,
)
from palimpsa_jax.layers.delta import GatedDeltaNet, PalimpsaD, QKVMixer
from palimpsa_jax.layers.mamba2 import Mamba2, PalimpsaM
from palimpsa_jax.layers.memory import (
    DeltaMemory,
    KernelMemory,
    LinearMemory,
    PalimpsaMemory,
)

__all__ = [
    "Attention",
    "DeltaMemory",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "KVCache",
    "KernelMemory",
    "LinearMemory",
    "Mamba2",
    "PalimpsaD",
    "PalimpsaM",
    "PalimpsaMemory",
    "QKVMixer",
    "RMSNorm",
    "RecurrentCache",
    "ShortConv",
    "SwiGLU",
    "rope",
    "segments",
]
