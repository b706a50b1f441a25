"""Mamba2 and Palimpsa-M (Mamba2 with the metaplastic memory, arXiv 2602.09075).

The parameters are those of the reference Mamba2 mixer (mamba_ssm / transformers' Mamba2Mixer),
one to one up to transposes: in_proj (d_model -> [z, xBC, dt]), conv1d (weight (W, conv_dim),
bias), dt_bias, A_log, D, norm (RMSNormGated, group size d_inner / n_groups,
norm_before_gate=False), out_proj. Palimpsa-M adds the beta projection (beta.W_b1, beta.W_b2,
beta.b_scale) and the prior (memory.prior.Ip_log).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers.common import (
    Array,
    GatedRMSNorm,
    RecurrentCache,
    ShortConv,
    segments,
)
from palimpsa_jax.layers.init import DEFAULT_INIT, Init, forget_gates, initializers, linear, param
from palimpsa_jax.layers.memory import LinearMemory, palimpsa_memory, remember


class Mamba2(nnx.Module):
    """Mamba2 mixer: h_t = exp(-A dt_t) h_{t-1} + (dt_t x_t) ⊗ B_t, y_t = h_t C_t + D x_t, then
    y = out_proj(norm(y, z)). Heads H = expand d_model / head_dim of size head_dim (= Dv);
    B, C (n_groups, d_state) shared by H / n_groups heads each (Dk = d_state); scale 1.
    bias: in_proj and out_proj biases; conv_bias: the convolution's."""

    def __init__(self, d_model: int, *, d_state: int = 128, n_groups: int = 1, expand: int = 2,
                 head_dim: int = 64, conv_size: int = 4, conv_bias: bool = True,
                 bias: bool = False, norm_eps: float = 1e-5,
                 dt_limit: tuple[float, float] = (0.0, math.inf), backend: str = "auto",
                 chunk_size: int | None = None, init: Init = DEFAULT_INIT, dtype=None,
                 rngs: nnx.Rngs):
        self.d_inner = expand * d_model
        if self.d_inner % head_dim or (self.d_inner // head_dim) % n_groups:
            raise ValueError(f"head_dim ({head_dim}) must divide expand * d_model ({self.d_inner}) "
                             f"into a number of heads that n_groups ({n_groups}) divides")
        self.num_heads, self.head_dim = self.d_inner // head_dim, head_dim
        self.d_state, self.n_groups, self.dt_limit = d_state, n_groups, dt_limit
        conv_dim = self.d_inner + 2 * n_groups * d_state
        self.in_proj = linear(d_model, self.d_inner + conv_dim + self.num_heads, ("embed", "heads"),
                              rngs, std=init.std, bias=bias, dtype=dtype)
        self.conv1d = ShortConv(conv_dim, conv_size, bias=conv_bias, std=init.conv_std, rngs=rngs)
        self.A_log, self.dt_bias = forget_gates(self.num_heads, rngs, init)
        self.D = param(initializers.ones_init(), (self.num_heads,), ("heads",), rngs,
                       weight_decay=False)
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // n_groups, norm_before_gate=False,
                                 eps=norm_eps, rngs=rngs)
        self.out_proj = linear(self.d_inner, d_model, ("heads", "embed"), rngs, std=init.std,
                               bias=bias, dtype=dtype)
        self.memory = LinearMemory(backend=backend, chunk_size=chunk_size)

    def init_cache(self, batch: int, max_length: int | None = None, dtype=jnp.float32
                   ) -> RecurrentCache:
        """Empty cache (max_length is unused: the state has a fixed size)."""
        state = self.memory.initial_state(batch, self.num_heads, self.d_state, self.head_dim)
        return RecurrentCache((self.conv1d.init_cache(batch, dtype),), state)

    def _recurrence(self, x, C, B, v, dt, log_alpha, state, segment_ids):
        """The selective SSM: o (B, T, H, head_dim), final state. x is the mixer's input."""
        return self.memory(C, B, v, log_alpha, scale=1.0, state=state, segment_ids=segment_ids)

    def __call__(self, x: Array, *, segment_ids: Array | None = None,
                 cache: RecurrentCache | None = None) -> tuple[Array, RecurrentCache | None]:
        """x: (B, T, d_model) -> y (B, T, d_model), cache."""
        batch, length, _ = x.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        z, xBC, dt = jnp.split(self.in_proj(x), [self.d_inner, 2 * self.d_inner + 2 * G * N], axis=-1)
        index = segments(segment_ids, batch, length).index
        xBC, conv_cache = self.conv1d(xBC, index, None if cache is None else cache.conv[0])
        xs, B, C = jnp.split(jax.nn.silu(xBC), [self.d_inner, self.d_inner + G * N], axis=-1)
        xs = xs.reshape(batch, length, H, P)
        B, C = (jnp.repeat(m.reshape(batch, length, G, N), H // G, axis=2) for m in (B, C))
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...]), *self.dt_limit)
        log_alpha = -jnp.exp(self.A_log[...]) * dt
        y, state = self._recurrence(x, C, B, (dt[..., None] * xs).astype(xs.dtype), dt, log_alpha,
                                    None if cache is None else cache.state, segment_ids)
        y = y + self.D[...][:, None] * xs
        y = self.out_proj(self.norm(y.reshape(batch, length, self.d_inner), z))
        return y, None if cache is None else RecurrentCache((conv_cache,), state)


class PalimpsaM(Mamba2):
    """Palimpsa-M: Mamba2 whose recurrence is the metaplastic memory with q = C, k = B, scale 1,
    v = dt x, log_alpha = -A dt and beta = sigmoid(W_b2 W_b1 x) softplus(b_scale) dt: the time
    step is both the forget and the input gate. metaplasticity=False with prior 1 is exactly
    Mamba2 (no beta projection)."""

    def __init__(self, d_model: int, *, beta_rank: int = 32, metaplasticity: bool = True,
                 learn_prior: bool = False, prior_family: str = "head", beta_rule: str = "low_rank",
                 backend: str = "auto",
                 chunk_size: int | None = None, init: Init = DEFAULT_INIT, dtype=None,
                 rngs: nnx.Rngs, **mamba2):
        super().__init__(d_model, backend=backend, chunk_size=chunk_size, init=init, dtype=dtype,
                         rngs=rngs, **mamba2)
        self.beta, self.memory = palimpsa_memory(
            d_model, self.num_heads, self.head_dim, self.d_state, metaplasticity=metaplasticity,
            beta_rank=beta_rank, prior_family=prior_family, learn_prior=learn_prior,
            std=init.std, backend=backend, chunk_size=chunk_size, dtype=dtype, rngs=rngs,
            beta_rule=beta_rule)

    def _recurrence(self, x, C, B, v, dt, log_alpha, state, segment_ids):
        return remember(self.beta, self.memory, C, B, v, log_alpha, hidden=x, input_gate=dt,
                        scale=1.0, state=state, segment_ids=segment_ids)
