"""Model configuration: one frozen dataclass, validated at construction."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from palimpsa_jax.kernels import rules
from palimpsa_jax.layers import registry
from palimpsa_jax.layers.init import DEFAULT_INIT, Init
from palimpsa_jax.layers.memory import PRIOR_FAMILIES

MIXER_NAMES = ("palimpsa_d", "palimpsa_m", "mamba2", "gated_deltanet", "attention")
BACKENDS = ("auto", "reference", "xla", "pallas_gpu")   # those of every kernel; "auto" = best per kernel
FINAL_NORMS = ("rmsnorm", "layernorm")
RULE_PREFIX = "rule_"     # "rule_<name>": kernels.rules.RULES[name] as a layer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A causal language model: embedding, n_layers blocks, final norm, head.

    mixers: mixer names repeated as a pattern over the n_layers layers, e.g. ("palimpsa_d",)
      for all layers or ("mamba2", "mamba2", "palimpsa_m") for a hybrid: the built-in
      MIXER_NAMES, "rule_<name>" (any rule of `kernels.rules.RULES` as a layer), a name an
      experiment registered (`layers.register_mixer`) or "module:attribute".
    num_heads, head_dim, expand_v: heads of palimpsa_d / gated_deltanet (Dk = head_dim,
      Dv = expand_v head_dim) and attention (num_heads x head_dim).
    ssm_*: mamba2 / palimpsa_m (d_inner = ssm_expand d_model in heads of ssm_head_dim = Dv,
      B and C of ssm_state = Dk in ssm_groups groups).
    beta_rank, metaplasticity, learn_prior, prior_family, beta_rule: the Palimpsa memory
      (palimpsa_d, palimpsa_m); prior_family "head" (H,), "row" (H, Dv) or "synapse"
      (H, Dv, Dk); beta_rule "low_rank" (the paper's) or a registered / "module:attribute" one.
    ssm_bias, ssm_conv_bias: biases of the Mamba2 in/out projections and of its convolution.
    mlp_hidden: SwiGLU width of every block's MLP; 0 = no MLP.
    final_norm: "rmsnorm" or "layernorm" before the head.
    forget_init, a_min, a_max, dt_min, dt_max, dt_floor, init_std, conv_init_std: the
      initialisation of every mixer (`palimpsa_jax.layers.Init`: the forget gates "mamba2"
      (random, the language-model default) or "ramp" (the authors' MQAR init), the std of
      Linear kernels and the embedding, of the short convolutions (None: PyTorch's uniform)).
    backend, chunk_size: kernel backend of the recurrent mixers (BACKENDS) and tokens per chunk
      (None: each kernel's default).
    dtype: computation dtype (parameters are float32).
    """
    vocab_size: int
    d_model: int
    n_layers: int
    mixers: tuple[str, ...] = ("palimpsa_d",)
    num_heads: int = 16
    head_dim: int = 48
    expand_v: int = 1
    conv_size: int = 4
    beta_rank: int = 32
    metaplasticity: bool = True
    learn_prior: bool = False
    prior_family: str = "head"
    beta_rule: str = "low_rank"
    ssm_state: int = 128
    ssm_groups: int = 1
    ssm_expand: int = 2
    ssm_head_dim: int = 64
    ssm_bias: bool = False
    ssm_conv_bias: bool = True
    mlp_hidden: int = 0
    tie_embeddings: bool = True
    final_norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    backend: str = "auto"
    chunk_size: int | None = None
    dtype: str = "float32"
    # the initialisation (palimpsa_jax.layers.init.Init, whose defaults these are)
    forget_init: str = DEFAULT_INIT.forget
    a_min: float = DEFAULT_INIT.a_min
    a_max: float = DEFAULT_INIT.a_max
    dt_min: float = DEFAULT_INIT.dt_min
    dt_max: float = DEFAULT_INIT.dt_max
    dt_floor: float = DEFAULT_INIT.dt_floor
    init_std: float = DEFAULT_INIT.std
    conv_init_std: float | None = DEFAULT_INIT.conv_std

    def __post_init__(self):
        if isinstance(self.mixers, str):
            object.__setattr__(self, "mixers", (self.mixers,))
        object.__setattr__(self, "mixers", tuple(self.mixers))
        positive = ("vocab_size", "d_model", "n_layers", "num_heads", "head_dim", "expand_v",
                    "conv_size", "beta_rank", "ssm_state", "ssm_groups", "ssm_expand",
                    "ssm_head_dim")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mlp_hidden, int) or self.mlp_hidden < 0:
            raise ValueError(f"mlp_hidden must be a non-negative integer (0 = no MLP), got {self.mlp_hidden!r}")
        for name in ("norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive integer or None, got {self.chunk_size!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("metaplasticity", "learn_prior", "tie_embeddings", "ssm_bias", "ssm_conv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        try:
            floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"dtype must name a floating dtype, got {self.dtype!r}")
        if self.final_norm not in FINAL_NORMS:
            raise ValueError(f"final_norm must be one of {FINAL_NORMS}, got {self.final_norm!r}")
        if self.prior_family not in PRIOR_FAMILIES:
            raise ValueError(f"prior_family must be one of {PRIOR_FAMILIES}, got "
                             f"{self.prior_family!r}")
        if self.prior_family == "synapse" and not self.metaplasticity:
            raise ValueError("prior_family 'synapse' needs metaplasticity (without it the "
                             "read-out divides each output row by one prior)")
        _ = self.init   # constructing the Init checks its fields
        if not self.mixers:
            raise ValueError("mixers must name at least one mixer")
        for name in self.mixers:
            check_mixer(name)
        registry.resolve(registry.BETA_RULES, "beta_rule", self.beta_rule)
        if self.n_layers % len(self.mixers):
            raise ValueError(f"n_layers ({self.n_layers}) must be a multiple of the length of the "
                             f"mixers pattern ({len(self.mixers)})")
        if "attention" in self.mixers and self.head_dim % 2:
            raise ValueError(f"head_dim must be even for attention (RoPE), got {self.head_dim}")
        if {"mamba2", "palimpsa_m"} & set(self.mixers):
            d_inner = self.ssm_expand * self.d_model
            if d_inner % self.ssm_head_dim:
                raise ValueError(f"ssm_head_dim ({self.ssm_head_dim}) must divide ssm_expand * "
                                 f"d_model ({d_inner})")
            if (d_inner // self.ssm_head_dim) % self.ssm_groups:
                raise ValueError(f"ssm_groups ({self.ssm_groups}) must divide the number of "
                                 f"Mamba2 heads ({d_inner // self.ssm_head_dim})")

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer name of every layer (the pattern repeated)."""
        return self.mixers * (self.n_layers // len(self.mixers))

    @property
    def init(self) -> Init:
        """The initialisation of the mixers."""
        return Init(forget=self.forget_init, a_min=self.a_min, a_max=self.a_max,
                    dt_min=self.dt_min, dt_max=self.dt_max, dt_floor=self.dt_floor,
                    std=self.init_std, conv_std=self.conv_init_std)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def check_mixer(name: str) -> None:
    """ValueError naming `mixers` unless `name` is a built-in, rule or registered mixer."""
    if name in MIXER_NAMES:
        return
    if name.startswith(RULE_PREFIX):
        if name[len(RULE_PREFIX):] not in rules.RULES:
            raise ValueError(f"mixers: {name!r} names no rule of kernels.rules.RULES "
                             f"({sorted(rules.RULES)})")
        return
    try:
        registry.resolve(registry.MIXERS, "mixer", name)
    except ValueError as e:
        raise ValueError(f"mixers: {e} (built in: {MIXER_NAMES}, or rule_<name>)") from None


def swiglu_hidden(d_model: int, ratio: float = 8 / 3, multiple: int = 256) -> int:
    """The usual SwiGLU width: ratio d_model rounded up to a multiple of `multiple`."""
    return multiple * math.ceil(ratio * d_model / multiple)
