"""How parameters start: the `Init` of a model (read from its `ModelConfig`) and the helpers that
create parameters with logical axis names.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, `vocab`, `conv`, `rank`) as
sharding metadata and are created without eager sharding, so no layer needs a mesh: a trainer
reads `nnx.get_partition_spec(nnx.state(model))` and maps the names to mesh axes with its rules.
Parameters that must not be weight-decayed carry `weight_decay=False` (see
`palimpsa_jax.models.weight_decay_mask`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

initializers = nnx.initializers
FORGET_INITS = ("mamba2", "ramp")


@dataclasses.dataclass(frozen=True)
class Init:
    """The initialisation of every mixer.

    forget: the forget gates alpha = exp(-A dt) of each head,
      "mamba2": A uniform in [a_min, a_max] and dt log-uniform in [dt_min, dt_max] (random);
      "ramp": deterministic over heads h = 0..H-1, A_h = linspace(a_min, a_max, H) and
        dt_h = exp(linspace(1, 0, H) (ln dt_max - ln dt_min) + ln dt_min) (the authors' MQAR
        "small forgetting": a_min, a_max = 0.01, 0.16; "very small": 0.001, 0.016).
      Either way dt >= dt_floor and dt_bias = softplus⁻¹(dt).
    std: every Linear kernel and the embedding are N(0, std²), biases 0.
    conv_std: short convolutions N(0, conv_std²); None: PyTorch's Conv1d default U(±1/sqrt(W)).
    The beta projection's rank -> H·Dv matrix is uniform in ±rank^-1/2 (both recipes).
    """
    forget: str = "mamba2"
    a_min: float = 1.0
    a_max: float = 16.0
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_floor: float = 1e-4
    std: float = 0.02
    conv_std: float | None = None

    def __post_init__(self):
        if self.forget not in FORGET_INITS:
            raise ValueError(f"forget_init must be one of {FORGET_INITS}, got {self.forget!r}")
        if not 0 < self.a_min <= self.a_max:
            raise ValueError(f"a_min, a_max must satisfy 0 < a_min <= a_max, got "
                             f"{self.a_min!r}, {self.a_max!r}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"dt_min, dt_max must satisfy 0 < dt_min <= dt_max, got "
                             f"{self.dt_min!r}, {self.dt_max!r}")
        if not self.dt_floor > 0:
            raise ValueError(f"dt_floor must be > 0, got {self.dt_floor!r}")
        if not self.std > 0 or (self.conv_std is not None and not self.conv_std > 0):
            raise ValueError(f"init_std and conv_init_std must be > 0, got {self.std!r}, "
                             f"{self.conv_std!r}")

    def forget_rates(self, num_heads: int, key) -> tuple[jax.Array, jax.Array]:
        """(A, dt), each (H,): drawn from `key` ("mamba2") or the deterministic ramp."""
        log_dt_range = (math.log(self.dt_min), math.log(self.dt_max))
        if self.forget == "ramp":
            A = jnp.linspace(self.a_min, self.a_max, num_heads)
            log_dt = jnp.linspace(1.0, 0.0, num_heads) * (log_dt_range[1] - log_dt_range[0])
            dt = jnp.exp(log_dt + log_dt_range[0])
        else:
            key_a, key_dt = jax.random.split(key)
            A = jax.random.uniform(key_a, (num_heads,), jnp.float32, self.a_min, self.a_max)
            dt = jnp.exp(jax.random.uniform(key_dt, (num_heads,), jnp.float32, *log_dt_range))
        return A.astype(jnp.float32), jnp.maximum(dt, self.dt_floor).astype(jnp.float32)


DEFAULT_INIT = Init()


class Constant(nnx.Variable):
    """A non-trainable variable (e.g. a fixed prior): not an `nnx.Param`, so optimisers skip it."""


def param(initializer, shape, names, rngs: nnx.Rngs, *, weight_decay=True, variable=nnx.Param):
    """A float32 variable of `shape` with logical axis `names`, drawn from `initializer`."""
    metadata = {} if weight_decay else {"weight_decay": False}
    partitioned = nnx.with_partitioning(initializer, tuple(names), eager_sharding=False, **metadata)
    return variable(partitioned(rngs.params(), shape, jnp.float32))


# The random initializers are compiled once per (value, shape, dtype): a model built eagerly
# (Trainer.init_state) then draws every parameter with the XLA computation a jit of the whole
# construction would use, so the values are bitwise those of `jax.jit(lambda: CausalLM(...))`,
# without compiling the whole construction (minutes on a GPU for a 170M model).
@functools.cache
def normal(std: float):
    """Initializer of N(0, std²)."""
    return jax.jit(initializers.normal(std), static_argnums=(1, 2))


@functools.cache
def uniform(bound: float):
    """Initializer of U(-bound, bound)."""
    return jax.jit(lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound),
                   static_argnums=(1, 2))


def linear(d_in: int, d_out: int, names, rngs: nnx.Rngs, *, std: float, bias=False,
           kernel_init=None, dtype=None) -> nnx.Linear:
    """Dense layer (d_in -> d_out), kernel N(0, std²) (or `kernel_init`) named `names`, optional
    zero bias; float32 parameters, computation in `dtype` (None: promote input and parameters)."""
    kernel_init = normal(std) if kernel_init is None else kernel_init
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
        kernel_init=nnx.with_partitioning(kernel_init, tuple(names), eager_sharding=False),
        bias_init=nnx.with_partitioning(initializers.zeros_init(), (names[1],),
                                        eager_sharding=False, weight_decay=False))


def inverse_softplus(x):
    return x + jnp.log(-jnp.expm1(-x))


def forget_gates(num_heads: int, rngs: nnx.Rngs, init: Init) -> tuple[nnx.Param, nnx.Param]:
    """A_log and dt_bias (H,) with A = exp(A_log), softplus(dt_bias) = dt as `init` says; no
    weight decay."""
    A_log, dt_bias = _forget_parameters(init, num_heads, rngs.params())
    as_param = lambda value: param(lambda *_: value, (num_heads,), ("heads",), rngs,
                                   weight_decay=False)
    return as_param(A_log), as_param(dt_bias)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forget_parameters(init: Init, num_heads: int, key) -> tuple[jax.Array, jax.Array]:
    A, dt = init.forget_rates(num_heads, key)
    return jnp.log(A), inverse_softplus(dt)
