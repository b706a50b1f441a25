"""Mixers against slow sequential float64 implementations written from the paper's equations (one
token and one head at a time), and their cache, packing and precision properties."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax import kernels
from palimpsa_jax.layers import (
    Attention,
    GatedDeltaNet,
    Mamba2,
    PalimpsaD,
    PalimpsaM,
    ShortConv,
)
from references import full_prior

D_MODEL, HEADS, HEAD_DIM, EXPAND_V = 16, 2, 4, 2
KERNEL = {"backend": "xla", "chunk_size": 4}   # chunk boundaries inside the test sequences
FACTORIES = {
    "palimpsa_d": lambda **kw: PalimpsaD(D_MODEL, HEADS, HEAD_DIM, expand_v=EXPAND_V, beta_rank=3,
                                         learn_prior=True, **KERNEL, **kw),
    "palimpsa_d_off": lambda **kw: PalimpsaD(D_MODEL, HEADS, HEAD_DIM, expand_v=EXPAND_V,
                                             metaplasticity=False, **KERNEL, **kw),
    "palimpsa_d_rows": lambda **kw: PalimpsaD(D_MODEL, HEADS, HEAD_DIM, expand_v=EXPAND_V,
                                              beta_rank=3, learn_prior=True, prior_family="row",
                                              **KERNEL, **kw),
    "palimpsa_m_synapses": lambda **kw: PalimpsaM(D_MODEL, d_state=4, n_groups=2, head_dim=8,
                                                  beta_rank=3, learn_prior=True,
                                                  prior_family="synapse", **KERNEL, **kw),
    "mamba2": lambda **kw: Mamba2(D_MODEL, d_state=4, n_groups=2, head_dim=8, **KERNEL, **kw),
    "palimpsa_m": lambda **kw: PalimpsaM(D_MODEL, d_state=4, n_groups=2, head_dim=8, beta_rank=3,
                                         **KERNEL, **kw),
    "palimpsa_m_off": lambda **kw: PalimpsaM(D_MODEL, d_state=4, n_groups=2, head_dim=8,
                                             metaplasticity=False, **KERNEL, **kw),
    "gated_deltanet": lambda **kw: GatedDeltaNet(D_MODEL, HEADS, HEAD_DIM, expand_v=EXPAND_V,
                                                 **KERNEL, **kw),
    "attention": lambda **kw: Attention(D_MODEL, HEADS, 2 * HEAD_DIM, **kw),
}
NAMES = sorted(FACTORIES)
# palimpsa_m_off runs Mamba2's code path (tested equal to it below) and palimpsa_d_rows
# palimpsa_d's with another prior shape: the property tests skip them
PROPERTY_NAMES = [name for name in NAMES if name not in ("palimpsa_m_off", "palimpsa_d_rows")]


@functools.cache
@functools.partial(nnx.jit, static_argnames=("name", "seed", "dtype"))
def make(name, seed=0, dtype=None):
    """The mixer with every variable perturbed away from its initialisation (priors included);
    built under jit, which is much faster than op by op on CPU, and shared by the tests (which
    do not modify it)."""
    mixer = FACTORIES[name](rngs=nnx.Rngs(seed), dtype=dtype)
    state = nnx.state(mixer)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    noise = [x + 0.5 * jax.random.normal(k, x.shape, x.dtype) / (x.shape[0] ** 0.5 if x.ndim == 2 else 1)
             for x, k in zip(leaves, keys)]
    nnx.update(mixer, jax.tree.unflatten(treedef, noise))
    return mixer


@nnx.jit
def call(mixer, x, segment_ids=None, cache=None):
    """mixer(x, ...) compiled once per shape (much faster than op-by-op on CPU)."""
    return mixer(x, segment_ids=segment_ids, cache=cache)


def inputs(seed, batch, length, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, D_MODEL), dtype)


def relative_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


# --- float64 sequential references ---------------------------------------------------------

def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def rms(x, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)


def causal_conv(x, weight, bias=0.0):
    """y_t = sum_j weight[W-1-j] x_{t-j} over j < W with t - j >= 0; x (T, C), weight (W, C)."""
    width = len(weight)
    return np.stack([sum(weight[width - 1 - j] * x[t - j] for j in range(min(width, t + 1)))
                     for t in range(len(x))]) + bias


def dense(p, x):
    return x @ p["kernel"] + p.get("bias", 0.0)


def palimpsa_step(mu, importance, q, k, v, beta, alpha, prior, scale):
    """README "The kernel API" for one head and token: returns mu_t, I_t, o_t."""
    importance_t = alpha * importance + (1 - alpha) * prior + np.outer(beta, k**2)
    mu = alpha * importance / importance_t * mu + np.outer(v, k) / importance_t
    return mu, importance_t, scale * mu @ q


def short_conv_heads(p, x, name, heads, dim):
    return silu(causal_conv(dense(p[f"W_{name}"], x), p[f"conv_{name}"]["weight"])).reshape(len(x), heads, dim)


def unit(x):
    return x / np.sqrt(np.sum(x**2, axis=-1, keepdims=True) + 1e-6)


def delta_family_reference(p, x, rule, eps=1e-5):
    """Palimpsa-D or Gated DeltaNet (README "Models") on one sequence x (T, d_model)."""
    T, H, Dk, Dv = len(x), HEADS, HEAD_DIM, EXPAND_V * HEAD_DIM
    q, k = unit(short_conv_heads(p, x, "q", H, Dk)), unit(short_conv_heads(p, x, "k", H, Dk))
    x_v = short_conv_heads(p, x, "v", H, Dv)
    alpha = np.exp(-np.exp(p["A_log"]) * softplus(dense(p["W_dt"], x) + p["dt_bias"]))   # (T, H)
    o = np.zeros((T, H, Dv))
    if rule == "gated_deltanet":
        beta = sigmoid(dense(p["W_b"], x))
        S = np.zeros((H, Dv, Dk))
        for t in range(T):
            for h in range(H):
                S[h] = (alpha[t, h] * S[h] @ (np.eye(Dk) - beta[t, h] * np.outer(k[t, h], k[t, h]))
                        + beta[t, h] * np.outer(x_v[t, h], k[t, h]))
                o[t, h] = Dk**-0.5 * S[h] @ q[t, h]
    else:
        s = sigmoid(dense(p["W_s"], x))
        prior = full_prior(np.exp(p["memory"]["prior"]["Ip_log"]), H, Dv, Dk)
        if p.get("beta"):
            gate = sigmoid(dense(p["beta"]["W_b2"], dense(p["beta"]["W_b1"], x))).reshape(T, H, Dv)
            beta = gate * softplus(p["beta"]["b_scale"])[:, None] * s[..., None]
        else:  # no metaplasticity: I stays at the prior, mu = S / I_prior
            beta = np.zeros((T, H, Dv))
        mu, importance = np.zeros((H, Dv, Dk)), prior.copy()
        for t in range(T):
            for h in range(H):
                mu[h], importance[h], o[t, h] = palimpsa_step(
                    mu[h], importance[h], q[t, h], k[t, h], s[t, h] * x_v[t, h], beta[t, h],
                    alpha[t, h], prior[h], Dk**-0.5)
        o = o + p["D"][:, None] * x_v
    gate = silu(dense(p["W_g"], x)).reshape(T, H, Dv)
    o = rms(o, eps) * p["norm"]["scale"].reshape(H, Dv) * gate
    return dense(p["W_o"], o.reshape(T, H * Dv))


def mamba2_family_reference(p, x, metaplastic, eps=1e-5):
    """Mamba2 (selective SSM with gated RMSNorm), or Palimpsa-M when `metaplastic` is not None:
    the same with the posterior (mu, I) memory, q = C, k = B, v = dt x, scale 1."""
    T, G, N, P = len(x), 2, 4, 8
    d_inner = 2 * D_MODEL
    H = d_inner // P
    z, xBC, dt = np.split(dense(p["in_proj"], x), [d_inner, 2 * d_inner + 2 * G * N], axis=-1)
    xBC = silu(causal_conv(xBC, p["conv1d"]["weight"], p["conv1d"]["bias"]))
    xs, B, C = np.split(xBC, [d_inner, d_inner + G * N], axis=-1)
    xs, B, C = xs.reshape(T, H, P), B.reshape(T, G, N), C.reshape(T, G, N)
    dt = softplus(dt + p["dt_bias"])
    alpha = np.exp(-np.exp(p["A_log"]) * dt)
    y = np.zeros((T, H, P))
    if metaplastic is None:
        h_state = np.zeros((H, P, N))
        for t in range(T):
            for h in range(H):
                g = h // (H // G)
                h_state[h] = alpha[t, h] * h_state[h] + dt[t, h] * np.outer(xs[t, h], B[t, g])
                y[t, h] = h_state[h] @ C[t, g]
    else:
        prior = full_prior(np.exp(p["memory"]["prior"]["Ip_log"]), H, P, N)
        beta = (sigmoid(dense(p["beta"]["W_b2"], dense(p["beta"]["W_b1"], x))).reshape(T, H, P)
                * softplus(p["beta"]["b_scale"])[:, None] * dt[..., None]) if metaplastic else np.zeros((T, H, P))
        mu, importance = np.zeros((H, P, N)), prior.copy()
        for t in range(T):
            for h in range(H):
                g = h // (H // G)
                mu[h], importance[h], y[t, h] = palimpsa_step(
                    mu[h], importance[h], C[t, g], B[t, g], dt[t, h] * xs[t, h], beta[t, h],
                    alpha[t, h], prior[h], 1.0)
    y = (y + p["D"][:, None] * xs).reshape(T, d_inner) * silu(z)
    y = (rms(y.reshape(T, G, d_inner // G), eps).reshape(T, d_inner)) * p["norm"]["scale"]
    return dense(p["out_proj"], y)


def attention_reference(p, x, theta=10000.0):
    """Causal softmax attention with rotary positions 0..T-1 (pairs (i, i + D/2))."""
    T, H, Dh = len(x), HEADS, 2 * HEAD_DIM
    q, k, v = (dense(p[f"W_{n}"], x).reshape(T, H, Dh) for n in "qkv")

    def rotate(u, position):
        out = u.copy()
        for i in range(Dh // 2):
            angle = position * theta ** (-i / (Dh // 2))
            c, s = np.cos(angle), np.sin(angle)
            out[..., i] = c * u[..., i] - s * u[..., i + Dh // 2]
            out[..., i + Dh // 2] = s * u[..., i] + c * u[..., i + Dh // 2]
        return out

    q = np.stack([rotate(q[t], t) for t in range(T)])
    k = np.stack([rotate(k[t], t) for t in range(T)])
    o = np.zeros((T, H, Dh))
    for t in range(T):
        for h in range(H):
            scores = np.array([q[t, h] @ k[s, h] for s in range(t + 1)]) / np.sqrt(Dh)
            weights = np.exp(scores - scores.max())
            o[t, h] = (weights / weights.sum()) @ v[: t + 1, h]
    return dense(p["W_o"], o.reshape(T, H * Dh))


REFERENCES = {
    "palimpsa_d": lambda p, x: delta_family_reference(p, x, "palimpsa"),
    "palimpsa_d_off": lambda p, x: delta_family_reference(p, x, "palimpsa"),
    "palimpsa_d_rows": lambda p, x: delta_family_reference(p, x, "palimpsa"),
    "palimpsa_m_synapses": lambda p, x: mamba2_family_reference(p, x, True),
    "gated_deltanet": lambda p, x: delta_family_reference(p, x, "gated_deltanet"),
    "mamba2": lambda p, x: mamba2_family_reference(p, x, None),
    "palimpsa_m": lambda p, x: mamba2_family_reference(p, x, True),
    "palimpsa_m_off": lambda p, x: mamba2_family_reference(p, x, False),
    "attention": attention_reference,
}


# --- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_matches_sequential_reference(name):
    mixer = make(name)
    x = inputs(1, 2, 9)
    y, cache = call(mixer, x)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(mixer)))
    reference = np.stack([REFERENCES[name](params, np.asarray(row, np.float64)) for row in x])
    assert cache is None and y.dtype == jnp.float32 and y.shape == x.shape
    assert relative_error(y, reference) < 1e-5


@pytest.mark.parametrize("name", PROPERTY_NAMES)
def test_prefill_then_decode_equals_full_forward(name):
    mixer = make(name)
    x = inputs(2, 2, 9)
    full, _ = call(mixer, x)
    outputs, cache = call(mixer, x[:, :4], cache=mixer.init_cache(2, 9))
    outputs = [outputs]
    for t in range(4, 9):
        y, cache = call(mixer, x[:, t:t + 1], cache=cache)
        outputs.append(y)
    assert relative_error(jnp.concatenate(outputs, axis=1), full) < 1e-5


@pytest.mark.parametrize("name", PROPERTY_NAMES)
def test_packed_sequences_equal_separate_ones(name):
    """Each row packs two sequences of lengths 4 and 5 (ids 4, 9 and 0, 1). Also: decoding after
    a packed prefill continues only the last sequence."""
    mixer = make(name)
    x = inputs(3, 2, 9)
    segment_ids = jnp.array([[4] * 4 + [9] * 5, [0] * 4 + [1] * 5], jnp.int32)
    packed, _ = call(mixer, x, segment_ids=segment_ids)
    separate = jnp.concatenate([call(mixer, x[:, :4])[0], call(mixer, x[:, 4:])[0]], axis=1)
    assert relative_error(packed, separate) < 1e-5

    token = inputs(4, 2, 1)
    _, cache = call(mixer, x, segment_ids=segment_ids, cache=mixer.init_cache(2, 10))
    continued, _ = call(mixer, token, cache=cache)
    _, cache = call(mixer, x[:, 4:], cache=mixer.init_cache(2, 10))
    assert relative_error(continued, call(mixer, token, cache=cache)[0]) < 1e-5


def test_palimpsa_m_without_metaplasticity_is_mamba2():
    mamba2 = make("mamba2", seed=5)
    palimpsa_m = nnx.jit(lambda: FACTORIES["palimpsa_m_off"](rngs=nnx.Rngs(0)))()
    nnx.update(palimpsa_m, nnx.state(mamba2))   # every Mamba2 weight; the prior stays 1
    assert palimpsa_m.beta is None and np.all(palimpsa_m.memory.prior() == 1.0)
    x = inputs(6, 2, 9)
    assert relative_error(call(palimpsa_m, x)[0], call(mamba2, x)[0]) < 1e-6
    assert ({"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(palimpsa_m, nnx.Param))}
            == {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(mamba2, nnx.Param))})


def test_palimpsa_d_without_metaplasticity_runs_on_the_gla_path(monkeypatch):
    calls = []
    gla = kernels.gla_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["backend"])
        return gla(*args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("palimpsa_attention must not be called without metaplasticity")

    monkeypatch.setattr(kernels, "gla_attention", spy)
    monkeypatch.setattr(kernels, "palimpsa_attention", forbidden)
    mixer = make("palimpsa_d_off")
    x = inputs(7, 1, 5)
    mixer(x)
    mixer(x[:, :1], cache=mixer.init_cache(1, 1))
    assert calls == ["xla", "reference"]
    assert mixer.beta is None   # the baseline has no beta parameters


@pytest.mark.parametrize("name", PROPERTY_NAMES)
def test_gradients_finite_with_bfloat16(name):
    mixer = make(name, dtype=jnp.bfloat16)
    x = inputs(8, 2, 9, jnp.bfloat16)
    segment_ids = jnp.array([[0] * 4 + [1] * 5] * 2, jnp.int32)

    def loss(mixer, x):
        y, _ = mixer(x, segment_ids=segment_ids)
        assert y.dtype == jnp.bfloat16
        return jnp.mean(y.astype(jnp.float32) ** 2)

    grads, x_grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mixer, x)
    leaves = jax.tree.leaves(grads) + [x_grad]
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in leaves)
    assert any(float(jnp.abs(g.astype(jnp.float32)).max()) > 0 for g in jax.tree.leaves(grads))


def test_short_conv_cache_and_segments():
    conv = ShortConv(3, 4, bias=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 3), jnp.float32)
    index = jnp.array([[0, 0, 0, 1, 1, 1]], jnp.int32)
    y, cache = conv(x, index)
    params = nnx.to_pure_dict(nnx.state(conv))
    w, b = np.asarray(params["weight"], np.float64), np.asarray(params["bias"], np.float64)
    expected = np.concatenate([causal_conv(np.asarray(x[0, :3], np.float64), w, b),
                               causal_conv(np.asarray(x[0, 3:], np.float64), w, b)])
    assert relative_error(y[0], expected) < 1e-6
    np.testing.assert_array_equal(cache, x[:, 3:])   # the last W-1 inputs of the last segment
    _, cache = conv(x[:, :5], index[:, :5])
    np.testing.assert_array_equal(cache[:, 0], 0.0)  # first slot belongs to the previous segment


def test_attention_cache_overflow_is_an_error_not_a_silent_overwrite():
    from palimpsa_jax.layers.attention import Attention
    attention = Attention(16, 2, 8, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 3, 16))
    _, cache = attention(x, cache=attention.init_cache(1, 4))
    with pytest.raises(ValueError, match="max_length"):
        attention(x, cache=cache)
    y, _ = nnx.jit(lambda m, x, c: m(x, cache=c))(attention, x, cache)  # unchecked under jit
    assert np.all(np.isnan(y))


def test_attention_uses_cudnn_only_where_it_applies(monkeypatch):
    from palimpsa_jax.layers import attention
    assert attention.implementation("auto", jnp.bfloat16, 64) == "xla"          # on this CPU
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    assert attention.implementation("auto", jnp.bfloat16, 64) == "cudnn"
    assert attention.implementation("auto", jnp.float16, 128) == "cudnn"
    assert attention.implementation("auto", jnp.float32, 64) == "xla"           # cuDNN: 16-bit
    assert attention.implementation("auto", jnp.bfloat16, 256) == "xla"         # head_dim <= 128
    assert attention.implementation("xla", jnp.bfloat16, 64) == "xla"
