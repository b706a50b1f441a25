"""palimpsa-lm-eval: lm-evaluation-harness's own command line, with the "palimpsa" model.

    palimpsa-lm-eval --model palimpsa --model_args workdir=runs/X,max_length=4096 \
        --tasks piqa,hellaswag --batch_size 32 [every other lm-eval flag; also `ls tasks`]

lm-eval finds a model only in its registry: its own lazy table (lm_eval.models.MODEL_MAPPING)
and what imported modules registered with `@register_model`. Version 0.4.13 reads no package
entry points, so a bare `lm_eval --model palimpsa` cannot find ours; this command imports
palimpsa_jax.evaluation.harness (which registers it) and then runs lm-eval's entry point.
model_args are `harness.PalimpsaLM`'s (workdir, step, max_length, max_gen_toks, seed); the
batch size is lm-eval's --batch_size. Also `python -m palimpsa_jax.commands.lm_eval`.
"""
from __future__ import annotations


def main():
    from lm_eval.__main__ import cli_evaluate

    import palimpsa_jax.evaluation.harness  # noqa: F401  (registers "palimpsa")

    cli_evaluate()


if __name__ == "__main__":
    main()
