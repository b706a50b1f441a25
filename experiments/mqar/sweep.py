"""The MQAR sweep of the paper: mixers x (sequence length, pairs) x learning rates x seeds.

    palimpsa-sweep --config experiments/mqar/sweep.py --workdir runs/mqar_sweep
    palimpsa-sweep --config experiments/mqar/sweep.py:paper --workdir runs/mqar_sweep_paper
    palimpsa-sweep --config experiments/mqar/sweep.py:paper,seeds=1,lengths=512 --workdir ...
    palimpsa-sweep --config experiments/mqar/sweep.py:paper,seeds=1,lrs=1+2,epochs=8,mixers=mamba2 ...

`:paper` is the authors' grid (values in `common.py`): Palimpsa-D, Palimpsa-D without
metaplasticity, Palimpsa-M, Mamba2 and Gated DeltaNet x (512 tokens, 128 pairs, batch 128) and
(1024 tokens, 256 pairs, batch 64) x learning rates logspace(1e-3, 1e-2, 4) x seeds 1-8, each
point up to 60 epochs with early stop. Options, to run part of it: `seeds=N` keeps seeds 1..N
and `seeds=A-B` seeds A..B (to add seeds to a run), `lengths=512` (or 1024) one setting,
`lrs=1+2` the learning rates of those indices (0-3), `epochs=N` a cosine over N epochs instead
of 60 (stepped per epoch, as the recipe), and `mixers=a+b` those mixers. The points that share a
model (learning rates x seeds) train together as one vmapped program on one device
(`palimpsa_jax.training.replicas`). No argument: a small CPU grid (Palimpsa-D and Gated DeltaNet
x 2 learning rates x 2 seeds of the CPU job, 150 steps each).
`--config.<key>=<value>` overrides a key in every point; `get_config(arg)` is the first point.
"""
from palimpsa_jax.experiments.mqar import common

OPTIONS = ("seeds", "lengths", "lrs", "epochs", "mixers")


def _options(arg: str) -> dict[str, str]:
    """"paper,seeds=3,lengths=512" -> {"seeds": "3", "lengths": "512"}."""
    options = {}
    for item in arg.split(",")[1:]:
        key, _, value = item.partition("=")
        if key not in OPTIONS or not value:
            raise ValueError(f"config argument {arg!r}: expected paper followed by options "
                             f",key=value with keys {OPTIONS}")
        options[key] = value
    return options


def _seeds(option: str, arg: str) -> tuple[int, ...]:
    """"3" -> seeds 1..3 of the paper's; "2-3" -> seeds 2..3."""
    first, dash, last = option.rpartition("-")
    if not (last.isdigit() and (first.isdigit() or not dash)):
        raise ValueError(f"config argument {arg!r}: seeds must be N or A-B, got {option!r}")
    first = int(first or 1)
    return tuple(s for s in common.PAPER_SEEDS if first <= s <= int(last))


def get_sweep(arg=None):
    if arg in (None, ""):
        points = []
        for mixer in ("palimpsa_d", "gated_deltanet"):
            for lr in (3e-3, 1e-2):
                for seed in (0, 1):
                    c = common.cpu(mixer)
                    c.seed, c.optim.lr = seed, lr
                    c.train.steps = 150
                    c.eval.every_steps = 0            # only at the end
                    points.append(c)
        return points
    if arg.split(",")[0] != "paper":
        raise ValueError(f"config argument must be empty or paper[,...], got {arg!r}")
    options = _options(arg)
    settings = [s for s in common.PAPER_SETTINGS
                if int(options.get("lengths", s[0])) == s[0]]
    seeds = _seeds(options.get("seeds", str(len(common.PAPER_SEEDS))), arg)
    lrs = [common.PAPER_LRS[int(i)] for i in options.get("lrs", "0+1+2+3").split("+")]
    mixers = options.get("mixers", "+".join(common.MIXERS)).split("+")
    epochs = int(options.get("epochs", common.PAPER_EPOCHS))
    if not (settings and seeds and set(mixers) <= set(common.MIXERS)):
        raise ValueError(f"config argument {arg!r}: no such lengths, seeds or mixers")
    return [common.paper(mixer, seq_len, num_pairs, batch_size, lr, seed, epochs=epochs)
            for mixer in mixers
            for seq_len, num_pairs, batch_size in settings
            for lr in lrs
            for seed in seeds]


def get_config(arg=None):
    return get_sweep(arg)[0]
