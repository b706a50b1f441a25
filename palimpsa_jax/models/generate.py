"""Sampling with the recurrent cache: prefill the prompt in one forward, then one token a step."""
from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.models.lm import CausalLM


def sample(logits: jax.Array, rng: jax.Array, *, temperature: float, top_k: int | None,
           top_p: float | None = None) -> jax.Array:
    """Token ids (B,) from logits (B, V): greedy if temperature == 0, else softmax(logits / T)
    restricted to the top_k largest logits when given, then to the nucleus when top_p is given:
    the most probable tokens whose probabilities, taken in decreasing order, first reach top_p
    (the most probable token always; tokens tied with the last one kept too)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        descending = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(descending, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        last = jnp.min(jnp.where(mass_before < top_p, descending, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < last, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, rng: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """Continues prompt (B, T) int by max_new_tokens tokens; returns them, (B, max_new_tokens).
    Sampling as `sample` (temperature, top_k, top_p in (0, 1]). segment_ids (B, T) int of the
    prompt, e.g. 0 on left padding and 1 on the prompt, so that the memory starts at the prompt
    (default: one segment); the new tokens continue the prompt's last segment.

    The recurrent mixers keep a fixed-size state (O(1) memory per new token); attention keeps a
    key-value cache of T + max_new_tokens slots.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 0 < top_k <= model.config.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size], got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32), segment_ids, rng, max_new_tokens,
                     temperature, top_k, top_p)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8))
def _generate(graphdef, state, prompt, segment_ids, rng, max_new_tokens, temperature, top_k, top_p):
    model = nnx.merge(graphdef, state)
    batch, length = prompt.shape
    draw = functools.partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)
    cache = model.init_cache(batch, length + max_new_tokens)
    logits, cache = model(prompt, segment_ids=segment_ids, cache=cache)
    rngs = jax.random.split(rng, max_new_tokens)
    first = draw(logits[:, -1], rngs[0])

    def step(carry, key):
        token, cache = carry
        logits, cache = model(token[:, None], cache=cache)
        next_token = draw(logits[:, -1], key)
        return (next_token, cache), next_token

    _, rest = jax.lax.scan(step, (first, cache), rngs[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def until_eos(tokens, eos_id: int) -> list[int]:
    """The ids of tokens (N,) before the first eos_id (all of them when there is none)."""
    tokens = [int(t) for t in tokens]
    return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


def generate_text(model: CausalLM, tokenizer, prompt: str, max_new_tokens: int, *,
                  num_samples: int = 1, **sampling) -> list[str]:
    """num_samples continuations of the text prompt (one batch, `generate` with `sampling`:
    temperature, top_k, top_p, rng), each decoded up to its first `tokenizer.eos_id`.

    A continuation is decode(prompt ids + new ids) less decode(prompt ids), so that tokenizers
    whose pieces carry the space before them (SentencePiece) keep it at the seam.
    """
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    new = generate(model, jnp.tile(jnp.asarray(ids, jnp.int32), (num_samples, 1)), max_new_tokens,
                   **sampling)
    head = tokenizer.decode(ids)
    return [tokenizer.decode(ids + until_eos(row, tokenizer.eos_id))[len(head):] for row in new]


def throughput(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *, repeats: int = 5,
               **sampling) -> dict[str, float]:
    """Seconds and tokens/s of `generate(model, prompt (B, T), max_new_tokens, **sampling)`,
    prefill and decode apart, each the median of `repeats` calls after a first that compiles:

    prefill: generate(..., 1), the prompt's forward and the first token, B * T tokens;
    generate_s: generate(..., max_new_tokens), when max_new_tokens > 1;
    decode: the difference, (max_new_tokens - 1) steps of B tokens, omitted when it is not
    positive (the decode steps lost in the timing's noise: too few of them to measure).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    batch, length = prompt.shape
    new_tokens = (1, max_new_tokens) if max_new_tokens > 1 else (1,)
    times = {n: [] for n in new_tokens}
    for n in new_tokens:
        jax.block_until_ready(generate(model, prompt, n, **sampling))
    for _ in range(repeats):   # interleaved, so that a slow spell of the machine hits both
        for n in new_tokens:
            start = time.perf_counter()
            jax.block_until_ready(generate(model, prompt, n, **sampling))
            times[n].append(time.perf_counter() - start)
    prefill = statistics.median(times[1])
    out = {"prefill_s": prefill, "prefill_tokens_per_s": batch * length / prefill}
    if max_new_tokens > 1:
        out["generate_s"] = statistics.median(times[max_new_tokens])
        if out["generate_s"] > prefill:
            step = (out["generate_s"] - prefill) / (max_new_tokens - 1)
            out.update(decode_s_per_step=step, decode_tokens_per_s=batch / step)
    return out
