"""Sampling with the recurrent cache: prefill the prompt in one forward, then one token a step."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.models.lm import CausalLM


def sample(logits: jax.Array, rng: jax.Array, *, temperature: float, top_k: int | None) -> jax.Array:
    """Token ids (B,) from logits (B, V): greedy if temperature == 0, else softmax(logits / T)
    restricted to the top_k largest logits when given."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, rng: jax.Array | None = None) -> jax.Array:
    """Continues prompt (B, T) int by max_new_tokens tokens; returns them, (B, max_new_tokens).

    The recurrent mixers keep a fixed-size state (O(1) memory per new token); attention keeps a
    key-value cache of T + max_new_tokens slots.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 0 < top_k <= model.config.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size], got {top_k}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32), rng, max_new_tokens,
                     temperature, top_k)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _generate(graphdef, state, prompt, rng, max_new_tokens, temperature, top_k):
    model = nnx.merge(graphdef, state)
    batch, length = prompt.shape
    draw = functools.partial(sample, temperature=temperature, top_k=top_k)
    cache = model.init_cache(batch, length + max_new_tokens)
    logits, cache = model(prompt, cache=cache)
    rngs = jax.random.split(rng, max_new_tokens)
    first = draw(logits[:, -1], rngs[0])

    def step(carry, key):
        token, cache = carry
        logits, cache = model(token[:, None], cache=cache)
        next_token = draw(logits[:, -1], key)
        return (next_token, cache), next_token

    _, rest = jax.lax.scan(step, (first, cache), rngs[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)
