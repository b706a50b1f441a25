"""Palimpsa-D and Gated DeltaNet: mixers with short-convolved q, k, v heads, a per-head time
step and a gated RMSNorm on the output. They share `QKVMixer`; each adds its own gates and
memory. Call contract: see `palimpsa_jax.layers`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers.common import (
    Array,
    GatedRMSNorm,
    RecurrentCache,
    ShortConv,
    l2_normalize,
    segments,
)
from palimpsa_jax.layers.init import DEFAULT_INIT, Init, forget_gates, initializers, linear, param
from palimpsa_jax.layers.memory import DeltaMemory, palimpsa_memory, remember


class QKVMixer(nnx.Module):
    """Shared backbone: q, k = L2norm(SiLU(ShortConv(W x))) (B, T, H, Dk),
    x_v = SiLU(ShortConv(W_v x)) (B, T, H, Dv), dt = softplus(W_dt x + dt_bias) (B, T, H),
    log_alpha = -exp(A_log) dt, and y = W_o GatedRMSNorm(o, W_g x) (norm, then SiLU gate, per
    head). Subclasses define `self.memory` and `_memory(x, q, k, x_v, log_alpha, state,
    segment_ids) -> (o (B, T, H, Dv), state)`."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, expand_v: int,
                 conv_size: int = 4, norm_eps: float = 1e-5, init: Init = DEFAULT_INIT, dtype=None,
                 rngs: nnx.Rngs):
        self.num_heads, self.dk, self.dv = num_heads, head_dim, expand_v * head_dim
        key_dim, value_dim = num_heads * self.dk, num_heads * self.dv
        dense = functools.partial(linear, rngs=rngs, std=init.std, dtype=dtype)
        self.W_q = dense(d_model, key_dim, ("embed", "heads"))
        self.W_k = dense(d_model, key_dim, ("embed", "heads"))
        self.W_v = dense(d_model, value_dim, ("embed", "heads"))
        self.W_g = dense(d_model, value_dim, ("embed", "heads"))
        self.W_dt = dense(d_model, num_heads, ("embed", "heads"))
        self.W_o = dense(value_dim, d_model, ("heads", "embed"))
        conv = functools.partial(ShortConv, width=conv_size, std=init.conv_std, rngs=rngs)
        self.conv_q, self.conv_k, self.conv_v = conv(key_dim), conv(key_dim), conv(value_dim)
        self.A_log, self.dt_bias = forget_gates(num_heads, rngs, init)
        self.norm = GatedRMSNorm(value_dim, self.dv, norm_before_gate=True, eps=norm_eps, rngs=rngs)

    def init_cache(self, batch: int, max_length: int | None = None, dtype=jnp.float32
                   ) -> RecurrentCache:
        """Empty cache (max_length is unused: the state has a fixed size)."""
        convs = tuple(c.init_cache(batch, dtype) for c in (self.conv_q, self.conv_k, self.conv_v))
        return RecurrentCache(convs, self.memory.initial_state(batch, self.num_heads, self.dk, self.dv))

    def __call__(self, x: Array, *, segment_ids: Array | None = None,
                 cache: RecurrentCache | None = None) -> tuple[Array, RecurrentCache | None]:
        batch, length, _ = x.shape
        index = segments(segment_ids, batch, length).index
        conv_caches = (None,) * 3 if cache is None else cache.conv
        (q, cache_q), (k, cache_k), (x_v, cache_v) = (
            conv(W(x), index, c) for conv, W, c in
            zip((self.conv_q, self.conv_k, self.conv_v), (self.W_q, self.W_k, self.W_v), conv_caches))
        heads = lambda z, d: jax.nn.silu(z).reshape(batch, length, self.num_heads, d)
        q, k, x_v = l2_normalize(heads(q, self.dk)), l2_normalize(heads(k, self.dk)), heads(x_v, self.dv)
        log_alpha = -jnp.exp(self.A_log[...]) * jax.nn.softplus(
            self.W_dt(x).astype(jnp.float32) + self.dt_bias[...])
        o, state = self._memory(x, q, k, x_v, log_alpha,
                                None if cache is None else cache.state, segment_ids)
        y = self.W_o(self.norm(o.reshape(batch, length, -1), self.W_g(x)))
        return y, None if cache is None else RecurrentCache((cache_q, cache_k, cache_v), state)


class PalimpsaD(QKVMixer):
    """Palimpsa-D (arXiv 2602.09075), a drop-in for a Gated DeltaNet layer.

    s = sigmoid(W_s x) (B, T, H) gates the value entering the memory, v = s x_v, and the
    precision beta = sigmoid(W_b2 W_b1 x) softplus(b_scale) s (`beta`, a BetaProjection);
    o = palimpsa(q, k, v, beta, log_alpha, I_prior) + D x_v. Dk = head_dim, Dv = expand_v
    head_dim, scale Dk^-1/2. The prior (`memory.prior`) is one per head, per value row or per
    synapse (prior_family), fixed or learned. metaplasticity=False: no beta projection, the
    non-metaplastic baseline o = S q / I_prior on `gla_attention`.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, expand_v: int = 1,
                 beta_rank: int = 32, metaplasticity: bool = True, learn_prior: bool = False,
                 prior_family: str = "head", beta_rule: str = "low_rank", backend: str = "auto",
                 chunk_size: int | None = None, init: Init = DEFAULT_INIT, dtype=None,
                 rngs: nnx.Rngs, **backbone):
        super().__init__(d_model, num_heads, head_dim, expand_v=expand_v, init=init, dtype=dtype,
                         rngs=rngs, **backbone)
        self.W_s = linear(d_model, num_heads, ("embed", "heads"), rngs, std=init.std, dtype=dtype)
        self.D = param(initializers.ones_init(), (num_heads,), ("heads",), rngs, weight_decay=False)
        self.beta, self.memory = palimpsa_memory(
            d_model, num_heads, self.dv, self.dk, metaplasticity=metaplasticity,
            beta_rank=beta_rank, prior_family=prior_family, learn_prior=learn_prior,
            std=init.std, backend=backend, chunk_size=chunk_size, dtype=dtype, rngs=rngs,
            beta_rule=beta_rule)

    def _memory(self, x, q, k, x_v, log_alpha, state, segment_ids):
        s = jax.nn.sigmoid(self.W_s(x).astype(jnp.float32))
        v = (s[..., None] * x_v).astype(x_v.dtype)
        o, state = remember(self.beta, self.memory, q, k, v, log_alpha, hidden=x, input_gate=s,
                            state=state, segment_ids=segment_ids)
        return o + self.D[...][:, None] * x_v, state


class GatedDeltaNet(QKVMixer):
    """Gated DeltaNet: S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ with
    beta = sigmoid(W_b x) (B, T, H) and log_alpha = -exp(A_log) dt (W_dt is the paper's W_a).
    State S (B, H, Dv, Dk) float32."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, expand_v: int = 2,
                 backend: str = "auto", chunk_size: int | None = None, init: Init = DEFAULT_INIT,
                 dtype=None, rngs: nnx.Rngs, **backbone):
        super().__init__(d_model, num_heads, head_dim, expand_v=expand_v, init=init, dtype=dtype,
                         rngs=rngs, **backbone)
        self.W_b = linear(d_model, num_heads, ("embed", "heads"), rngs, std=init.std, dtype=dtype)
        self.memory = DeltaMemory(backend=backend, chunk_size=chunk_size)

    def _memory(self, x, q, k, x_v, log_alpha, state, segment_ids):
        beta = jax.nn.sigmoid(self.W_b(x).astype(jnp.float32)).astype(q.dtype)
        return self.memory(q, k, x_v, beta, log_alpha, state=state, segment_ids=segment_ids)
