"""Model FLOPs per token, counted analytically from a `ModelConfig`, and the peak FLOP/s of the
usual accelerators: what model FLOP utilisation (MFU) is computed from.

Convention (a FLOP is one add, multiply or divide; a multiply-add is 2):

- Every matrix multiply: 2 d_in d_out per token for each projection (mixers, SwiGLU MLP, the
  output head or tied logits), and 2 W C for a short convolution of width W over C channels.
  The embedding lookup, norms, activations, gates, RoPE and the softmax are not counted.
- Attention: the score and value matmuls over all T keys, 4 H Dh T per token, with no causal
  discount (PaLM's convention: training 6 N + 12 L H Dh T per token; the masked half is
  computed anyway).
- Recurrent mixers, per token and head (Dk, Dv; chunk C = min(chunk size, T), the config's
  chunk_size or the kernel's default 64, again without a causal discount):
  Mamba2 / GLA (chunked form): state update 2 Dk Dv, read-out of the entering state 2 Dk Dv,
  intra-chunk scores 2 C Dk and values 2 C Dv.
  Gated DeltaNet (chunked WY form): as GLA plus the correction W S_inᵀ (2 Dk Dv), the Gram
  matrix K Kᵀ (2 C Dk), the unit-lower-triangular inverse (C² / 3) and its product with
  [beta V | beta K] (2 C (Dk + Dv)).
  Palimpsa (metaplastic): the recurrence itself, 11 Dk Dv: M_t = alpha M + v ⊗ k (3),
  Ibar_t = alpha Ibar + beta ⊗ k² (3), o = scale (M / (Ibar + prior)) q (add, divide, multiply,
  multiply-add: 5). Its read-out is elementwise in the state, so no chunked form avoids
  forming every token's state; the chunked XLA backend forms them with a (C x C) @
  (C x 2 Dk Dv) decay matmul, 4 C Dk Dv more per token: that backend's overhead, not model
  FLOPs (the Pallas kernels run the recurrence). Without metaplasticity: the GLA form.
  Rule mixers ("rule_<name>", sequential): the rule's own per-token update and read-out
  (`RULE_STATE_FLOPS`).
- Training: 3 x forward (the backward pass costs twice the forward); rematerialisation is not
  model work and is not counted.
"""
from __future__ import annotations

from collections.abc import Callable

from palimpsa_jax.kernels import rules
from palimpsa_jax.kernels.gated_deltanet.chunk import DEFAULT_CHUNK_SIZE as DELTA_CHUNK
from palimpsa_jax.kernels.gla.chunk import DEFAULT_CHUNK_SIZE as GLA_CHUNK
from palimpsa_jax.models.config import RULE_PREFIX, ModelConfig

# Dense bf16 peak FLOP/s of one device (one chip; jax.devices()[0].device_kind), without
# sparsity. Exact device kinds; the GPUs are also matched by `peak_flops` below.
PEAK_FLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989e12,   # H100 SXM
    "NVIDIA H200": 989e12,             # H200 SXM
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,             # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,                  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,             # v6e (Trillium)
    "TPU v6e": 918e12,
}

# Per-token, per-head forward FLOPs of each sequential rule (`kernels.rules`), f(Dk, Dv):
# the state update and the read-out S q (2 Dk Dv).
RULE_STATE_FLOPS: dict[str, Callable[[int, int], float]] = {
    "mamba2": lambda dk, dv: 5 * dk * dv,              # alpha S + (beta v / prior) ⊗ k
    "deltanet": lambda dk, dv: 8 * dk * dv,            # alpha S + beta (v - alpha S k) kᵀ
    "gated_deltanet": lambda dk, dv: 8 * dk * dv,
    "longhorn": lambda dk, dv: 7 * dk * dv,            # S - (eps ⊗ k²) S + (eps v) ⊗ k
    "palimpsa": lambda dk, dv: 12 * dk * dv,           # I and mu updates, mu = evidence / I
    # P (Dk x Dk) update, mu P, Cholesky and two triangular solves of P_t
    "mesa": lambda dk, dv: 4 * dv * dk**2 + dk**3 / 3 + 5 * dk**2 + 6 * dk * dv,
}


def linear(d_in: int, d_out: int) -> float:
    """One projection (d_in -> d_out) of one token."""
    return 2.0 * d_in * d_out


def attention_core(heads: int, head_dim: int, seq_len: int) -> float:
    """softmax(q Kᵀ) V of one token over all seq_len keys (no causal discount)."""
    return 4.0 * heads * head_dim * seq_len


def gla_core(heads: int, dk: int, dv: int, chunk: int) -> float:
    """Chunked GLA / Mamba2 of one token: state update and read-out, intra-chunk q·k and
    scores @ v."""
    return heads * (4.0 * dk * dv + 2.0 * chunk * (dk + dv))


def delta_core(heads: int, dk: int, dv: int, chunk: int) -> float:
    """Chunked gated delta rule (WY form) of one token: see the module docstring."""
    return heads * (6.0 * dk * dv + 2.0 * chunk * (3 * dk + 2 * dv) + chunk**2 / 3)


def palimpsa_core(heads: int, dk: int, dv: int) -> float:
    """The metaplastic recurrence of one token: updates of M and Ibar, read-out through
    M / (Ibar + prior)."""
    return heads * 11.0 * dk * dv


def _chunk(config: ModelConfig, default: int, seq_len: int) -> int:
    return min(config.chunk_size or default, seq_len)


def _beta_projection(c: ModelConfig, heads: int, dv: int) -> float:
    """The low-rank precision projection W_b2 W_b1 x (`layers.BetaProjection`)."""
    if c.beta_rule != "low_rank":
        raise ValueError(f"no FLOP count for beta_rule {c.beta_rule!r} (only 'low_rank')")
    return linear(c.d_model, c.beta_rank) + linear(c.beta_rank, heads * dv)


def _qkv_backbone(c: ModelConfig) -> float:
    """`layers.delta.QKVMixer`: W_q, W_k (H Dk), W_v, W_g (H Dv), W_dt (H), W_o, three convs."""
    d, h, dk, dv = c.d_model, c.num_heads, c.head_dim, c.expand_v * c.head_dim
    return (2 * linear(d, h * dk) + 2 * linear(d, h * dv) + linear(d, h) + linear(h * dv, d)
            + 2.0 * c.conv_size * h * (2 * dk + dv))


def _ssm_backbone(c: ModelConfig) -> tuple[float, int, int, int]:
    """`layers.mamba2.Mamba2` without its recurrence: in_proj (d -> [z, xBC, dt]), conv1d over
    xBC, out_proj. Returns (FLOPs, heads, Dk = d_state, Dv = head_dim)."""
    d_inner = c.ssm_expand * c.d_model
    heads = d_inner // c.ssm_head_dim
    conv_dim = d_inner + 2 * c.ssm_groups * c.ssm_state
    flops = (linear(c.d_model, d_inner + conv_dim + heads) + 2.0 * c.conv_size * conv_dim
             + linear(d_inner, c.d_model))
    return flops, heads, c.ssm_state, c.ssm_head_dim


def mixer_flops(config: ModelConfig, mixer: str, seq_len: int) -> float:
    """Forward FLOPs of one token through one mixer layer (projections and kernel) in a
    sequence of seq_len tokens. ValueError for a mixer without a count (registered ones)."""
    c = config
    h, dk, dv = c.num_heads, c.head_dim, c.expand_v * c.head_dim
    if mixer == "attention":
        return 4 * linear(c.d_model, h * dk) + attention_core(h, dk, seq_len)
    if mixer == "gated_deltanet":
        return (_qkv_backbone(c) + linear(c.d_model, h)
                + delta_core(h, dk, dv, _chunk(c, DELTA_CHUNK, seq_len)))
    if mixer == "palimpsa_d":
        flops = _qkv_backbone(c) + linear(c.d_model, h)                    # + W_s
        if not c.metaplasticity:
            return flops + gla_core(h, dk, dv, _chunk(c, GLA_CHUNK, seq_len))
        return flops + _beta_projection(c, h, dv) + palimpsa_core(h, dk, dv)
    if mixer in ("mamba2", "palimpsa_m"):
        flops, h, dk, dv = _ssm_backbone(c)
        if mixer == "mamba2" or not c.metaplasticity:
            return flops + gla_core(h, dk, dv, _chunk(c, GLA_CHUNK, seq_len))
        return flops + _beta_projection(c, h, dv) + palimpsa_core(h, dk, dv)
    if mixer.startswith(RULE_PREFIX):
        name = mixer[len(RULE_PREFIX):]
        if name not in RULE_STATE_FLOPS:
            raise ValueError(f"no FLOP count for the rule of mixer {mixer!r}")
        beta = (_beta_projection(c, h, dv) if rules.RULES[name].vector_beta
                else linear(c.d_model, h))
        return (_qkv_backbone(c) + linear(c.d_model, h) + beta
                + h * RULE_STATE_FLOPS[name](dk, dv))
    raise ValueError(f"no FLOP count for mixer {mixer!r} (counted: the built-in mixers and "
                     f"rule_<name>)")


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of one token of a (., seq_len) batch: every layer's mixer and SwiGLU MLP
    (3 matmuls d_model <-> mlp_hidden) and the output head (d_model -> vocab)."""
    per_layer = {m: mixer_flops(config, m, seq_len) for m in set(config.layer_mixers)}
    mlp = 3 * linear(config.d_model, config.mlp_hidden)
    return (sum(per_layer[m] + mlp for m in config.layer_mixers)
            + linear(config.d_model, config.vocab_size))


def train_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token: forward and backward, 3 x forward."""
    return 3.0 * forward_flops_per_token(config, seq_len)


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind (`PEAK_FLOPS`; any H100 / H200 SXM or
    A100), or None when unknown (CPUs, PCIe / NVL H100 and H200, other chips)."""
    if device_kind in PEAK_FLOPS:
        return PEAK_FLOPS[device_kind]
    if device_kind.startswith("NVIDIA"):
        if "A100" in device_kind:
            return 312e12
        if ("H100" in device_kind or "H200" in device_kind) and not (
                "PCIe" in device_kind or "NVL" in device_kind):
            return 989e12
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOP utilisation: achieved model FLOP/s over `peak` (all devices together)."""
    return tokens_per_s * flops_per_token / peak
