"""Argument checks shared by every kernel entry point.

Shapes and dtypes are checked always; value constraints (prior > 0, log_alpha <= 0, beta >= 0)
are checked whenever the value is concrete (eager calls). Under `jax.jit` values are abstract and
those checks are skipped: validate once eagerly, or trust the layer that produced the gates.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


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


def check_values(name: str, x, predicate, requirement: str) -> None:
    """Raises if a concrete `x` violates `predicate` (a NumPy boolean function)."""
    if _is_concrete(x):
        values = np.asarray(jax.device_get(x), dtype=np.float64)
        if values.size and not bool(np.all(predicate(values))):
            raise ValueError(f"{name} must be {requirement}")


def check_qkv(q, k, v, log_alpha) -> tuple[int, int, int, int, int]:
    """Checks the shared shape conventions; returns (B, T, H, Dk, Dv)."""
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
    check_values("log_alpha", log_alpha, lambda a: a <= 0, "<= 0 everywhere (alpha = exp(log_alpha) <= 1)")
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
    """`state` must be a tuple of len(parts) floating arrays, each of `shape`."""
    if not isinstance(state, (tuple, list)) or len(state) != len(parts):
        raise ValueError(f"{name} must be a tuple ({', '.join(parts)}), got {type(state).__name__}")
    for part, x in zip(parts, state):
        check_floating(f"{name}[{part}]", x)
        check_shape(f"{name}[{part}]", x, shape, "(B, H, Dv, Dk)")
