"""The MQAR sweep of the paper (SPEC section 5): mixers x (sequence, pairs) x learning rates.

    python -m palimpsa_jax.sweep --config experiments/mqar/sweep.py --workdir runs/mqar_sweep
    python -m palimpsa_jax.sweep --config experiments/mqar/sweep.py:paper --workdir runs/mqar_sweep_paper

`:paper`: Palimpsa-D, Palimpsa-D with metaplasticity off, Mamba2 and Gated DeltaNet x
(sequence 512, 128 pairs, batch 128) and (sequence 1024, 256 pairs, batch 64), each evaluated
on its own setting, x learning rates logspace(1e-3, 1e-2, 4): 32 runs of the same number of
epochs. No argument: a small CPU grid (Palimpsa-D and Gated DeltaNet x sequence 64 x 2 learning
rates, 300 steps each: 1200 steps in all, three times the CPU variant's 400; not timed end to
end).
`--config.<key>=<value>` overrides a key in every point; `get_config(arg)` is the first point
(`python -m palimpsa_jax.train --config experiments/mqar/sweep.py ...` runs it alone).
"""
import numpy as np

from palimpsa_jax.training import mqar_config

# (mqar_config mixer, model changes): palimpsa_d, palimpsa_d_off, mamba2, gated_deltanet
PAPER_MIXERS = (("palimpsa_d", {}), ("palimpsa_d", {"metaplasticity": False}), ("mamba2", {}),
                ("gated_deltanet", {}))
PAPER_SETTINGS = ((512, 128, 128), (1024, 256, 64))   # (sequence length, pairs, batch size)
PAPER_LRS = np.logspace(np.log10(1e-3), np.log10(1e-2), 4)


def _paper_point(mixer, model_changes, seq_len, num_pairs, batch_size, lr):
    c = mqar_config(mixer, "paper", **model_changes)
    epochs = c.train.steps * c.batch_size / c.data.num_train     # of the paper config (batch 128)
    c.data.update(seq_len=seq_len, num_pairs=num_pairs, eval_slices=((seq_len, num_pairs),))
    c.batch_size = batch_size
    c.train.steps = round(epochs * c.data.num_train / batch_size)
    c.optim.lr = float(lr)
    return c


def _cpu_point(mixer, lr):
    c = mqar_config(mixer)
    c.train.steps = 300
    c.optim.update(lr=lr, warmup_steps=30)
    c.checkpoint.every_steps = 100
    c.eval.every_steps = 0                  # only at the end
    return c


def get_sweep(arg=None):
    if arg == "paper":
        return [_paper_point(mixer, changes, *setting, lr)
                for mixer, changes in PAPER_MIXERS
                for setting in PAPER_SETTINGS
                for lr in PAPER_LRS]
    if arg in (None, ""):
        return [_cpu_point(mixer, lr) for mixer in ("palimpsa_d", "gated_deltanet")
                for lr in (3e-3, 1e-2)]
    raise ValueError(f"config argument must be empty or 'paper', got {arg!r}")


def get_config(arg=None):
    return get_sweep(arg)[0]
