r"""palimpsa-generate: text from a trained run, with the recurrent cache.

    palimpsa-generate --workdir runs/lm_palimpsa_d --prompt "Once upon a time" \
        [--prompt_file prompt.txt] [--max_new_tokens 200] [--temperature 0.8] [--top_k 50] \
        [--top_p 0.95] [--seed 0] [--num_samples 1] [--step S]

Loads the run's checkpoint (the latest, or --step) and its tokenizer, encodes the prompt, and
draws --num_samples continuations in one batch (`models.generate`: the prompt in one forward,
then one token a step; the recurrent mixers keep a fixed-size state, so memory per new token is
constant). Each is cut at its first end-of-document token and printed after the prompt. Then
the speed, timed after compilation (medians of 5 calls): the prefill (the prompt's tokens/s) and
the decode (tokens/s of the later steps; "not measured" when they take no measurable time).
--temperature 0 is greedy; --top_k 0 and --top_p 1 turn those filters off.
Also `python -m palimpsa_jax.commands.generate`.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
from absl import app, flags

from palimpsa_jax.analysis.run import load_run
from palimpsa_jax.commands import common
from palimpsa_jax.data.tokenizer import run_tokenizer
from palimpsa_jax.models.generate import generate_text, throughput


def _define_flags():
    flags.DEFINE_string("workdir", None, "Directory of the run.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("prompt", None, "The prompt text.")
    flags.DEFINE_string("prompt_file", None, "A file holding the prompt text (instead of --prompt).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.", lower_bound=1)
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0: greedy.", lower_bound=0)
    flags.DEFINE_integer("top_k", 50, "Sample among the top_k most likely tokens; 0: all.", lower_bound=0)
    flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass, in (0, 1]; 1: off.")
    flags.DEFINE_integer("seed", 0, "Seed of the sampling.")
    flags.DEFINE_integer("num_samples", 1, "Continuations drawn (one batch).", lower_bound=1)
    flags.mark_flag_as_required("workdir")
    flags.register_validator("workdir", lambda w: (pathlib.Path(w) / "config.json").is_file(),
                             "--workdir must be a run directory (one holding config.json)")
    flags.register_validator("top_p", lambda p: 0 < p <= 1, "--top_p must be in (0, 1]")

    @flags.multi_flags_validator(["prompt", "prompt_file"])
    def _one_prompt(values):
        if (values["prompt"] is None) == (values["prompt_file"] is None):
            raise flags.ValidationError("give exactly one of --prompt and --prompt_file")
        if values["prompt_file"] is not None and not pathlib.Path(values["prompt_file"]).is_file():
            raise flags.ValidationError(f"--prompt_file {values['prompt_file']} does not exist")
        if _prompt(values["prompt"], values["prompt_file"]) == "":
            raise flags.ValidationError("--prompt must not be empty" if values["prompt"] is not None
                                        else f"--prompt_file {values['prompt_file']} is empty")
        return True


def _prompt(prompt: str | None, prompt_file: str | None) -> str:
    return prompt if prompt is not None else pathlib.Path(prompt_file).read_text()


def _main():
    f = flags.FLAGS
    run = load_run(f.workdir, f.step)
    tokenizer = run_tokenizer(f.workdir)
    if f.top_k > run.model.config.vocab_size:
        raise app.UsageError(f"--top_k must be at most the vocabulary size {run.model.config.vocab_size}")
    prompt = _prompt(f.prompt, f.prompt_file)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise app.UsageError("--prompt encodes to no tokens")
    sampling = dict(temperature=f.temperature, top_k=f.top_k or None,
                    top_p=None if f.top_p == 1 else f.top_p, rng=jax.random.PRNGKey(f.seed))
    texts = generate_text(run.model, tokenizer, prompt, f.max_new_tokens, num_samples=f.num_samples,
                          **sampling)
    for i, text in enumerate(texts):
        print(f"=== sample {i + 1} of {len(texts)} (step {run.step}) ===\n{prompt}{text}")
    batch = jnp.tile(jnp.asarray(ids, jnp.int32), (f.num_samples, 1))
    speed = throughput(run.model, batch, f.max_new_tokens, **sampling)
    print(f"=== speed on {jax.devices()[0].platform}, timed after compilation ===\n"
          f"prefill: {len(ids)} tokens x {f.num_samples} in {1e3 * speed['prefill_s']:.1f} ms, "
          f"{speed['prefill_tokens_per_s']:.0f} tokens/s")
    if "decode_tokens_per_s" in speed:
        print(f"decode: {1e3 * speed['decode_s_per_step']:.2f} ms per step of {f.num_samples} "
              f"tokens, {speed['decode_tokens_per_s']:.0f} tokens/s")
    elif "generate_s" in speed:
        print(f"decode: not measured ({f.max_new_tokens} new tokens took "
              f"{1e3 * speed['generate_s']:.1f} ms, no longer than the prefill)")


def main():
    _define_flags()
    common.run(_main)


if __name__ == "__main__":
    main()
