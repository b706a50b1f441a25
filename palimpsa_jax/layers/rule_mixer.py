"""Any update rule of `palimpsa_jax.kernels.rules` as a token mixer, on the sequential reference:
a new rule goes from a few lines to a trained model.

`RuleMemory(rule)` runs `rules.run` for every (sequence, head); `RuleMixer` is Palimpsa-D's
backbone (short-convolved q, k, v heads, the Mamba2-style forget gate, gated RMSNorm output)
around it. The rules take the raw value and the input precision separately (the table of the
README's "The unified view"): here v = x_v, and beta = sigmoid(W_b2 W_b1 x) softplus(b_scale) s
(B, T, H, Dv) for rules with a vector beta, sigmoid(W_b x) s (B, T, H) for the scalar ones, with
s = sigmoid(W_s x). In a `ModelConfig` the mixer "rule_<name>" uses `rules.RULES[name]`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.kernels import rules
from palimpsa_jax.layers.delta import QKVMixer
from palimpsa_jax.layers.init import DEFAULT_INIT, Init, initializers, linear, param
from palimpsa_jax.layers.memory import BetaProjection, Memory, Prior, record

PREFIX = "rule_"


class RuleMemory(Memory):
    """A memory updated by `rule` token by token (the reference, float32), one scalar prior
    per head. State: the rule's state per (sequence, head), leaves with leading axes (B, H)."""

    def __init__(self, rule: rules.Rule, *, prior: Prior):
        if prior.family != "head":
            raise ValueError(f"prior_family must be 'head' for a rule mixer, got {prior.family!r}")
        super().__init__(backend="reference")
        self.rule, self.prior = rule, prior

    def initial_state(self, batch: int, heads: int, dk: int, dv: int):
        state = jax.vmap(lambda p: self.rule.init(dk, dv, p))(self.prior())
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *x.shape)), state)

    def __call__(self, q, k, v, beta, log_alpha, *, scale=None, state=None, segment_ids=None):
        if segment_ids is not None:
            raise ValueError("segment_ids: a rule mixer runs `rules.run`, which has no resets; "
                             "train it on unpacked sequences")
        prior = self.prior()
        record(self, q=q, k=k, v=v, beta=beta, log_alpha=log_alpha, scale=scale,
               segment_ids=None)
        batch, _, heads, dk = q.shape
        if state is None:
            state = self.initial_state(batch, heads, dk, v.shape[-1])
        heads_first = lambda x: jnp.moveaxis(x.astype(jnp.float32), 2, 1)   # (B, H, T, ...)

        def one(q, k, v, beta, log_alpha, prior, state):
            return rules.run(self.rule, q, k, v, beta, log_alpha, prior, scale=scale, state=state)

        per_head = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, 0))
        o, state = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, None, 0))(
            heads_first(q), heads_first(k), heads_first(v), heads_first(beta),
            heads_first(log_alpha), prior, state)
        return jnp.moveaxis(o, 1, 2).astype(v.dtype), state


class RuleMixer(QKVMixer):
    """Palimpsa-D's backbone around `RuleMemory(rules.RULES[rule])` (see the module docstring);
    o = rule outputs + D x_v."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, rule: str,
                 expand_v: int = 1, beta_rank: int = 32, learn_prior: bool = False,
                 init: Init = DEFAULT_INIT, dtype=None, rngs: nnx.Rngs, **backbone):
        if rule not in rules.RULES:
            raise ValueError(f"rule must be one of {sorted(rules.RULES)} (kernels.rules.RULES), "
                             f"got {rule!r}")
        super().__init__(d_model, num_heads, head_dim, expand_v=expand_v, init=init, dtype=dtype,
                         rngs=rngs, **backbone)
        self.rule = rules.RULES[rule]
        self.W_s = linear(d_model, num_heads, ("embed", "heads"), rngs, std=init.std, dtype=dtype)
        self.D = param(initializers.ones_init(), (num_heads,), ("heads",), rngs, weight_decay=False)
        if self.rule.vector_beta:
            self.beta = BetaProjection(d_model, num_heads, self.dv, rank=beta_rank, std=init.std,
                                       dtype=dtype, rngs=rngs)
        else:
            self.beta = linear(d_model, num_heads, ("embed", "heads"), rngs, std=init.std,
                               dtype=dtype)
        prior = Prior(num_heads, self.dv, self.dk, family="head", learn=learn_prior, rngs=rngs)
        self.memory = RuleMemory(self.rule, prior=prior)

    def _memory(self, x, q, k, x_v, log_alpha, state, segment_ids):
        s = jax.nn.sigmoid(self.W_s(x).astype(jnp.float32))
        if self.rule.vector_beta:
            beta = self.beta(x, s)
        else:
            beta = jax.nn.sigmoid(self.beta(x).astype(jnp.float32)) * s
        o, state = self.memory(q, k, x_v, beta, log_alpha, state=state, segment_ids=segment_ids)
        return o + self.D[...][:, None] * x_v, state
