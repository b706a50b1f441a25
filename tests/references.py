"""Independent float64 implementations of the recurrences (README "The kernel API" and "The
unified view"; arXiv 2602.09075), written from the equations: Palimpsa in the (mu, I) form, GLA
and Gated DeltaNet.

`*_numpy` are plain NumPy loops (for values); `*_jax64` are the same equations in float64 JAX
(for autodiff). Segment ids reset the state to its default.
"""
import jax
import jax.numpy as jnp
import numpy as np


def full_prior(prior, H, Dv, Dk, xp=np):
    """A prior of shape (H,), (H, Dv) or (H, Dv, Dk) as an (H, Dv, Dk) array."""
    prior = xp.asarray(prior)
    return xp.broadcast_to(prior.reshape(prior.shape + (1,) * (3 - prior.ndim)), (H, Dv, Dk))


def palimpsa_numpy(q, k, v, beta, log_alpha, prior, scale, initial_state=None, segment_ids=None):
    """Returns o (B, T, H, Dv), (mu, I) each (B, H, Dv, Dk), variance (B, T, H, Dv); float64.
    prior: (H,), (H, Dv) or (H, Dv, Dk)."""
    q, k, v, beta, log_alpha, prior = (np.asarray(x, np.float64) for x in (q, k, v, beta, log_alpha, prior))
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    prior = full_prior(prior, H, Dv, Dk)
    default_I = np.broadcast_to(prior[None], (B, H, Dv, Dk))
    if initial_state is None:
        mu, I = np.zeros((B, H, Dv, Dk)), default_I.copy()
    else:
        mu, I = (np.array(x, np.float64) for x in initial_state)
    o = np.zeros((B, T, H, Dv))
    var = np.zeros((B, T, H, Dv))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                mu[b], I[b] = 0.0, default_I[b]
            for h in range(H):
                alpha = np.exp(log_alpha[b, t, h])
                I_prev = I[b, h].copy()
                I[b, h] = alpha * I_prev + (1 - alpha) * prior[h] + np.outer(beta[b, t, h], k[b, t, h] ** 2)
                mu[b, h] = alpha * (I_prev / I[b, h]) * mu[b, h] + np.outer(v[b, t, h], k[b, t, h]) / I[b, h]
                o[b, t, h] = scale * mu[b, h] @ q[b, t, h]
                var[b, t, h] = scale**2 * (1.0 / I[b, h]) @ (q[b, t, h] ** 2)
    return o, (mu, I), var


def gla_numpy(q, k, v, log_alpha, scale, initial_state=None, segment_ids=None):
    """Returns o (B, T, H, Dv) and S (B, H, Dv, Dk); float64."""
    q, k, v, log_alpha = (np.asarray(x, np.float64) for x in (q, k, v, log_alpha))
    B, T, H, Dk = q.shape
    S = np.zeros((B, H, v.shape[-1], Dk)) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros(v.shape)
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                S[b] = 0.0
            for h in range(H):
                S[b, h] = np.exp(log_alpha[b, t, h]) * S[b, h] + np.outer(v[b, t, h], k[b, t, h])
                o[b, t, h] = scale * S[b, h] @ q[b, t, h]
    return o, S


def palimpsa_jax64(q, k, v, beta, log_alpha, prior, mu0, I0, scale, segment_ids=None):
    """Float64 (mu, I) recurrence as a lax.scan, for autodiff (prior of any of the three
    shapes). Returns o, (mu, I), variance."""
    B, T, H, Dk = q.shape
    keep = (jnp.ones((B, T)) if segment_ids is None else
            jnp.concatenate([jnp.ones((B, 1)), (segment_ids[:, 1:] == segment_ids[:, :-1])], 1))
    prior = full_prior(prior, H, v.shape[-1], Dk, xp=jnp)

    def step(state, x):
        mu, I = state
        q_t, k_t, v_t, beta_t, log_alpha_t, keep_t = x
        keep_t = keep_t[:, None, None, None]
        mu, I = keep_t * mu, keep_t * I + (1 - keep_t) * prior
        alpha = jnp.exp(log_alpha_t)[..., None, None]
        I_new = alpha * I + (1 - alpha) * prior + beta_t[..., :, None] * (k_t**2)[..., None, :]
        mu = (alpha * I * mu + v_t[..., :, None] * k_t[..., None, :]) / I_new
        o = scale * jnp.einsum("bhvk,bhk->bhv", mu, q_t)
        var = scale**2 * jnp.einsum("bhvk,bhk->bhv", 1 / I_new, q_t**2)
        return (mu, I_new), (o, var)

    xs = tuple(jnp.moveaxis(jnp.asarray(x, jnp.float64), 1, 0) for x in (q, k, v, beta, log_alpha, keep))
    (mu, I), (o, var) = jax.lax.scan(step, (mu0, I0), xs)
    return jnp.moveaxis(o, 0, 1), (mu, I), jnp.moveaxis(var, 0, 1)


def gla_jax64(q, k, v, log_alpha, S0, scale, segment_ids=None):
    """Float64 GLA recurrence as a lax.scan, for autodiff. Returns o, S."""
    B, T = q.shape[:2]
    keep = (jnp.ones((B, T)) if segment_ids is None else
            jnp.concatenate([jnp.ones((B, 1)), (segment_ids[:, 1:] == segment_ids[:, :-1])], 1))

    def step(S, x):
        q_t, k_t, v_t, log_alpha_t, keep_t = x
        S = (keep_t[:, None, None, None] * jnp.exp(log_alpha_t)[..., None, None] * S
             + v_t[..., :, None] * k_t[..., None, :])
        return S, scale * jnp.einsum("bhvk,bhk->bhv", S, q_t)

    xs = tuple(jnp.moveaxis(jnp.asarray(x, jnp.float64), 1, 0) for x in (q, k, v, log_alpha, keep))
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1), S


def gated_delta_numpy(q, k, v, beta, log_alpha, scale, initial_state=None, segment_ids=None):
    """Float64 loop of S_t = alpha_t S_{t-1} (Id - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ,
    o_t = scale S_t q_t. Returns o (B, T, H, Dv) and S (B, H, Dv, Dk)."""
    q, k, v, beta, log_alpha = (np.asarray(x, np.float64) for x in (q, k, v, beta, log_alpha))
    B, T, H, Dk = q.shape
    S = np.zeros((B, H, v.shape[-1], Dk)) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros(v.shape)
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                S[b] = 0.0
            for h in range(H):
                kt, bt = k[b, t, h], beta[b, t, h]
                S[b, h] = (np.exp(log_alpha[b, t, h]) * S[b, h] @ (np.eye(Dk) - bt * np.outer(kt, kt))
                           + bt * np.outer(v[b, t, h], kt))
                o[b, t, h] = scale * S[b, h] @ q[b, t, h]
    return o, S


def gated_delta_jax64(q, k, v, beta, log_alpha, S0, scale, segment_ids=None):
    """The same recurrence as a float64 lax.scan, for autodiff (call under jax.enable_x64)."""
    B, T = q.shape[:2]
    keep = (jnp.ones((B, T)) if segment_ids is None else
            jnp.concatenate([jnp.ones((B, 1)), (segment_ids[:, 1:] == segment_ids[:, :-1])], 1))

    def step(S, x):
        q_t, k_t, v_t, beta_t, log_alpha_t, keep_t = x
        S = (keep_t[:, None] * jnp.exp(log_alpha_t))[..., None, None] * S
        S = S + beta_t[..., None, None] * (v_t - jnp.einsum("bhvk,bhk->bhv", S, k_t))[..., :, None] * k_t[..., None, :]
        return S, scale * jnp.einsum("bhvk,bhk->bhv", S, q_t)

    xs = tuple(jnp.moveaxis(jnp.asarray(x, jnp.float64), 1, 0) for x in (q, k, v, beta, log_alpha, keep))
    S, o = jax.lax.scan(step, jnp.asarray(S0, jnp.float64), xs)
    return jnp.moveaxis(o, 0, 1), S


def relative_error(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


def random_inputs(seed: int, B: int, T: int, H: int, Dk: int, Dv: int, dtype=np.float32):
    """Realistic random kernel inputs (never zeros) as NumPy arrays.

    Returns q, k (B, T, H, Dk) and v, beta (B, T, H, Dv) in `dtype`; log_alpha (B, T, H) in
    [-3, 0) and prior (H,) in [0.3, 3], float32; segment_ids (B, T) with a few random boundaries.
    """
    rng = np.random.default_rng(seed)
    cast = lambda x: np.asarray(jnp.asarray(x, dtype))
    q = cast(rng.normal(size=(B, T, H, Dk)))
    k = cast(rng.normal(size=(B, T, H, Dk)) / np.sqrt(Dk))
    v = cast(rng.normal(size=(B, T, H, Dv)))
    beta = cast(rng.uniform(0.05, 2.0, size=(B, T, H, Dv)))
    log_alpha = -rng.uniform(0.0, 3.0, size=(B, T, H)).astype(np.float32) ** 2
    prior = rng.uniform(0.3, 3.0, size=(H,)).astype(np.float32)
    segment_ids = np.cumsum(rng.uniform(size=(B, T)) < 0.1, axis=1).astype(np.int32)
    return q, k, v, beta, log_alpha, prior, segment_ids
