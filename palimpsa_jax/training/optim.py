"""AdamW with warmup + decay, global-norm clipping, weight-decay masks and a separate learning
rate for the metaplastic parameters, from the `optim` section of the config."""
from __future__ import annotations

import jax
import optax
from flax import nnx

# Parameters of the Bayesian memory (PalimpsaMemory): the precision projection and scale and
# the (learned) prior. `optim.metaplastic_lr` applies to these.
METAPLASTIC_PARAMS = ("W_b1", "W_b2", "b_scale", "Ip_log")


def schedule(optim, steps: int, peak: float | None = None) -> optax.Schedule:
    """Linear warmup from 0 to the peak (optim.lr, or `peak`) over optim.warmup_steps, then
    cosine or linear decay to optim.min_lr_ratio * peak at `steps`, or constant. The rate is
    held over blocks of optim.schedule_every_steps steps (a schedule stepped once an epoch): it
    is the schedule's value at the start of the block."""
    peak = optim.lr if peak is None else peak
    warmup = min(optim.warmup_steps, steps)
    decay_steps = max(steps - warmup, 1)
    end = optim.min_lr_ratio * peak
    after = {
        "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=optim.min_lr_ratio),
        "linear": optax.linear_schedule(peak, end, decay_steps),
        "constant": optax.constant_schedule(peak),
    }[optim.schedule]
    smooth = optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])
    block = optim.get("schedule_every_steps", 1)
    return smooth if block == 1 else (lambda step: smooth(step // block * block))


def param_groups(params: nnx.State) -> nnx.State:
    """'metaplastic' for the parameters named in METAPLASTIC_PARAMS, else 'default'."""
    def group(path, _):
        names = {getattr(key, "key", getattr(key, "name", None)) for key in path}
        return "metaplastic" if names & set(METAPLASTIC_PARAMS) else "default"
    return jax.tree_util.tree_map_with_path(group, params)


def optimizer(optim, steps: int, params: nnx.State, decay_mask: nnx.State,
              peak: float | None = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimiser and its base learning-rate schedule.

    clip_by_global_norm -> Adam moments -> decoupled weight decay (where decay_mask, or on
    every parameter with optim.decay_every_parameter) -> minus the learning rate of the
    parameter's group (= optax.adamw with one LR per group). `peak` replaces optim.lr (1.0: a
    schedule of relative rates, for replicas that scale the update by their own rate).
    """
    base = schedule(optim, steps, peak)
    if optim.get("decay_every_parameter", False):
        decay_mask = jax.tree.map(lambda _: True, decay_mask)
    ratio = 1.0 if optim.metaplastic_lr is None else optim.metaplastic_lr / optim.lr
    lr_of = {"default": optax.scale_by_learning_rate(base),
             "metaplastic": optax.scale_by_learning_rate(lambda step: ratio * base(step))}
    tx = optax.chain(
        optax.clip_by_global_norm(optim.clip_norm) if optim.clip_norm > 0 else optax.identity(),
        optax.scale_by_adam(optim.b1, optim.b2, optim.eps),
        optax.add_decayed_weights(optim.weight_decay, mask=decay_mask),
        optax.multi_transform(lr_of, param_groups(params)),
    )
    return tx, base
