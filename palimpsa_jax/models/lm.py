"""The causal language model: embedding, blocks `x + Mixer(RMSNorm(x))` then
`x + MLP(RMSNorm(x))` (MLP optional), final RMSNorm or LayerNorm, tied or untied head."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import (
    Attention,
    GatedDeltaNet,
    LayerNorm,
    Mamba2,
    PalimpsaD,
    PalimpsaM,
    RMSNorm,
    RuleMixer,
    SwiGLU,
    registry,
)
from palimpsa_jax.layers.common import embedding_lookup
from palimpsa_jax.layers.init import normal
from palimpsa_jax.models.config import RULE_PREFIX, ModelConfig

Array = jax.Array


def _palimpsa(c: ModelConfig) -> dict:
    return {"beta_rank": c.beta_rank, "metaplasticity": c.metaplasticity,
            "learn_prior": c.learn_prior, "prior_family": c.prior_family,
            "beta_rule": c.beta_rule}


def _recurrent(c: ModelConfig) -> dict:
    return {"conv_size": c.conv_size, "norm_eps": c.norm_eps, "backend": c.backend,
            "chunk_size": c.chunk_size, "init": c.init}


def _ssm(c: ModelConfig) -> dict:
    return {"d_state": c.ssm_state, "n_groups": c.ssm_groups, "expand": c.ssm_expand,
            "head_dim": c.ssm_head_dim, "bias": c.ssm_bias, "conv_bias": c.ssm_conv_bias,
            **_recurrent(c)}


MIXERS: dict[str, Callable[..., nnx.Module]] = {
    "palimpsa_d": lambda c, **kw: PalimpsaD(c.d_model, c.num_heads, c.head_dim, expand_v=c.expand_v,
                                            **_palimpsa(c), **_recurrent(c), **kw),
    "gated_deltanet": lambda c, **kw: GatedDeltaNet(c.d_model, c.num_heads, c.head_dim,
                                                    expand_v=c.expand_v, **_recurrent(c), **kw),
    "mamba2": lambda c, **kw: Mamba2(c.d_model, **_ssm(c), **kw),
    "palimpsa_m": lambda c, **kw: PalimpsaM(c.d_model, **_palimpsa(c), **_ssm(c), **kw),
    "attention": lambda c, **kw: Attention(c.d_model, c.num_heads, c.head_dim,
                                           rope_theta=c.rope_theta, backend=c.backend,
                                           init=c.init, **kw),
}


def mixer_factory(name: str) -> Callable[..., nnx.Module]:
    """factory(config, *, dtype, rngs) of a mixer name: built in (MIXERS), "rule_<name>"
    (`layers.RuleMixer` around kernels.rules.RULES[name]), registered or "module:attribute"."""
    if name in MIXERS:
        return MIXERS[name]
    if name.startswith(RULE_PREFIX):
        return lambda c, **kw: RuleMixer(c.d_model, c.num_heads, c.head_dim,
                                         rule=name[len(RULE_PREFIX):], expand_v=c.expand_v,
                                         beta_rank=c.beta_rank, learn_prior=c.learn_prior,
                                         conv_size=c.conv_size, norm_eps=c.norm_eps,
                                         init=c.init, **kw)
    return registry.resolve(registry.MIXERS, "mixer", name)


class Block(nnx.Module):
    """x + Mixer(RMSNorm(x)), then x + MLP(RMSNorm(x)) when mlp_hidden > 0."""

    def __init__(self, config: ModelConfig, mixer: str, *, rngs: nnx.Rngs):
        dtype = config.compute_dtype
        self.mixer_norm = RMSNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
        self.mixer = mixer_factory(mixer)(config, dtype=dtype, rngs=rngs)
        if config.mlp_hidden:
            self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
            self.mlp = SwiGLU(config.d_model, config.mlp_hidden, std=config.init_std, dtype=dtype,
                              rngs=rngs)
        else:
            self.mlp_norm = self.mlp = None

    def __call__(self, x: Array, *, segment_ids=None, cache=None):
        y, cache = self.mixer(self.mixer_norm(x), segment_ids=segment_ids, cache=cache)
        x = x + y.astype(x.dtype)
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
        return x, cache


class CausalLM(nnx.Module):
    """tokens (B, T) int -> logits (B, T, vocab) float32.

    `logits, cache = model(tokens, segment_ids=None, cache=None)`: without a cache a
    full-sequence forward (cache None returned); with `model.init_cache(batch, max_length)` it
    continues from the cache (prefill, then one token at a time). With `positions` (B, K) int,
    the logits (B, K, vocab) of those positions alone: the final norm and the head skip the
    others (an MQAR loss scores a quarter of the tokens).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = config.compute_dtype
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
            embedding_init=nnx.with_partitioning(normal(config.init_std),
                                                 ("vocab", "embed"), eager_sharding=False))
        self.blocks = nnx.List([Block(config, mixer, rngs=rngs) for mixer in config.layer_mixers])
        final_norm = RMSNorm if config.final_norm == "rmsnorm" else LayerNorm
        self.norm = final_norm(config.d_model, eps=config.norm_eps, rngs=rngs)
        self.head = None if config.tie_embeddings else nnx.Linear(
            config.d_model, config.vocab_size, use_bias=False, dtype=dtype,
            param_dtype=jnp.float32, rngs=rngs,
            kernel_init=nnx.with_partitioning(normal(config.init_std),
                                              ("embed", "vocab"), eager_sharding=False))

    def init_cache(self, batch: int, max_length: int, dtype=None) -> tuple:
        """Per-layer caches for up to max_length tokens in total (the attention layers' key-value
        slots; recurrent states have a fixed size); activations in `dtype`, default the
        compute dtype, recurrent states in float32."""
        dtype = self.config.compute_dtype if dtype is None else dtype
        return tuple(block.mixer.init_cache(batch, max_length, dtype) for block in self.blocks)

    def __call__(self, tokens: Array, *, segment_ids: Array | None = None, cache: tuple | None = None,
                 positions: Array | None = None):
        x = embedding_lookup(self.embed.embedding[...], tokens).astype(self.config.compute_dtype)
        caches = (None,) * len(self.blocks) if cache is None else cache
        new_caches = []
        for block, layer_cache in zip(self.blocks, caches):
            x, layer_cache = block(x, segment_ids=segment_ids, cache=layer_cache)
            new_caches.append(layer_cache)
        if positions is not None:
            x = jnp.take_along_axis(x, positions[..., None], axis=1)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.float32), None if cache is None else tuple(new_caches)


def weight_decay_mask(model: nnx.Module) -> nnx.State:
    """A pytree of bools over `nnx.state(model, nnx.Param)`: False for parameters without
    weight decay (A_log, dt_bias, D, b_scale, Ip_log, norm scales, biases), True otherwise.
    Usable as optax.adamw's `mask` on the same state."""
    return jax.tree.map(lambda v: v.get_metadata().get("weight_decay", True),
                        nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable))


def count_params(config: ModelConfig) -> int:
    """Number of trainable parameters, from abstract shapes (nothing is allocated)."""
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
