"""Argument checks shared by every kernel entry point.

Shapes and dtypes are checked always. Values are checked whenever they are concrete (eager
calls): every floating input must be finite ("contains NaN or inf"; `log_alpha` may be -inf,
a full reset), then the constraints (prior > 0, log_alpha <= 0, beta >= 0). Each value check is
one reduction on the device and one boolean back to the host. Under `jax.jit` values are
abstract and only shapes and dtypes are checked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_platform(backend: str, platform: str, interpret) -> None:
    """A Pallas backend runs its kernels on `platform` ("gpu" or "tpu") or, with `interpret`, in
    Pallas interpret mode anywhere; elsewhere a ValueError naming the backend."""
    if not interpret and jax.default_backend() != platform:
        mode = "TPU interpret mode" if platform == "tpu" else "interpret mode"
        raise ValueError(f"backend {backend!r} needs a {platform.upper()} (found "
                         f"{jax.default_backend()!r}); pass interpret=True to run it in Pallas "
                         f"{mode}")


def check_floating(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")


def check_shape(name: str, x, expected: tuple[int, ...], layout: str) -> None:
    if tuple(jnp.shape(x)) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(jnp.shape(x))}")


def check_same_dtype(reference_name: str, reference, **others) -> None:
    for name, x in others.items():
        if jnp.result_type(x) != jnp.result_type(reference):
            raise ValueError(
                f"{name} has dtype {jnp.result_type(x)} but {reference_name} has "
                f"{jnp.result_type(reference)}: they must match")


def check_values(name: str, x, predicate=None, requirement: str = "",
                 allow_negative_infinity: bool = False) -> None:
    """Raises if a concrete `x` holds NaN or inf (-inf allowed if asked), or violates
    `predicate` (a jnp boolean function) somewhere."""
    if not is_concrete(x) or jnp.size(x) == 0:
        return
    x = jnp.asarray(x)
    finite = jnp.isfinite(x) | ((x == -jnp.inf) if allow_negative_infinity else False)
    if not bool(jnp.all(finite)):
        raise ValueError(f"{name} contains NaN or {'+inf' if allow_negative_infinity else 'inf'}")
    if predicate is not None and not bool(jnp.all(predicate(x))):
        raise ValueError(f"{name} must be {requirement}")


def check_qkv(q, k, v, log_alpha) -> tuple[int, int, int, int, int]:
    """Checks the shared shape conventions and values; returns (B, T, H, Dk, Dv)."""
    if jnp.ndim(q) != 4:
        raise ValueError(f"q must have shape (B, T, H, Dk), got {tuple(jnp.shape(q))}")
    batch, length, heads, dk = jnp.shape(q)
    check_floating("q", q)
    check_shape("k", k, (batch, length, heads, dk), "(B, T, H, Dk)")
    if jnp.ndim(v) != 4 or tuple(jnp.shape(v)[:3]) != (batch, length, heads):
        raise ValueError(f"v must have shape (B, T, H, Dv) = ({batch}, {length}, {heads}, Dv), "
                         f"got {tuple(jnp.shape(v))}")
    dv = jnp.shape(v)[3]
    if min(batch, length, heads, dk, dv) == 0:
        raise ValueError(f"empty dimension in q {tuple(jnp.shape(q))} or v {tuple(jnp.shape(v))}")
    check_same_dtype("q", q, k=k, v=v)
    check_shape("log_alpha", log_alpha, (batch, length, heads), "(B, T, H)")
    check_floating("log_alpha", log_alpha)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_values(name, x)
    check_values("log_alpha", log_alpha, lambda a: a <= 0,
                 "<= 0 everywhere (alpha = exp(log_alpha) <= 1)", allow_negative_infinity=True)
    return batch, length, heads, dk, dv


def check_segment_ids(segment_ids, batch: int, length: int) -> None:
    if segment_ids is None:
        return
    check_shape("segment_ids", segment_ids, (batch, length), "(B, T)")
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
        raise ValueError(f"segment_ids must be integers, got dtype {jnp.result_type(segment_ids)}")


def check_scale(scale) -> None:
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive Python number or None, got {scale!r}")


def check_state(name: str, state, shape: tuple[int, ...], parts: tuple[str, ...]) -> None:
    """`state` must be a tuple of len(parts) finite floating arrays, each of `shape`."""
    if not isinstance(state, (tuple, list)) or len(state) != len(parts):
        raise ValueError(f"{name} must be a tuple ({', '.join(parts)}), got {type(state).__name__}")
    for part, x in zip(parts, state):
        check_floating(f"{name}[{part}]", x)
        check_shape(f"{name}[{part}]", x, shape, "(B, H, Dv, Dk)")
        check_values(f"{name}[{part}]", x)
