"""Logical axis names mapped to a device mesh (MaxText style).

Parameters carry logical axis names (`embed`, `heads`, `mlp`, `vocab`, `conv`, `rank`, see
`palimpsa_jax.layers.common`); activations use `batch` and `heads`. A list of rules maps each name
to mesh axes of a mesh with the axes (data, fsdp, tensor). Nothing here needs a mesh: without
one (`active_mesh()` is None) every helper is the identity, so the same model code runs on one
device, on simulated CPU devices and on GPU/TPU meshes.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes. Batches are split over data and fsdp; parameters are split along
# `embed` over fsdp (ZeRO-3 style) and along heads / MLP width / vocabulary over tensor.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("conv", None),
    ("rank", None),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A mesh with axes MESH_AXES of the given sizes; one size may be -1 (all remaining devices).

    Raises ValueError naming `mesh.<axis>` when the sizes do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; the axes are {MESH_AXES}")
    sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{axis} must be a positive size or -1, got {size}")
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {free}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % fixed:
            raise ValueError(f"mesh.{free[0]} = -1: the other axes ({fixed} devices) do not divide "
                             f"the {len(devices)} devices")
        sizes[free[0]] = len(devices) // fixed
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh: {sizes} needs {math.prod(sizes.values())} devices, "
                         f"there are {len(devices)}")
    grid = np.asarray(devices).reshape([sizes[axis] for axis in MESH_AXES])
    return jax.sharding.Mesh(grid, MESH_AXES)


def _axis_names(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def axis_size(mesh_shape: Mapping[str, int], axes: str | tuple[str, ...] | None) -> int:
    """Devices along the mesh axes of one PartitionSpec entry (1 for None); mesh_shape is
    `mesh.shape` or any axis -> size mapping."""
    return math.prod(mesh_shape[a] for a in _axis_names(axes))


def check_rules(rules: Rules, axis_names: Sequence[str]) -> None:
    """Every rule maps a logical name to None, a mesh axis or a tuple of mesh axes."""
    for name, axes in rules:
        for axis in _axis_names(axes):
            if axis not in axis_names:
                raise ValueError(f"sharding.rules: {name!r} maps to {axis!r}, which is not a mesh "
                                 f"axis ({tuple(axis_names)})")


def logical_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """PartitionSpec of an array whose axes have the logical `names` (None = replicated)."""
    table = dict(rules)
    missing = [n for n in names if n is not None and n not in table]
    if missing:
        raise ValueError(f"sharding.rules has no rule for the logical axes {missing}")
    return PartitionSpec(*(None if n is None else table[n] for n in names))


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh, rules: Rules) -> nnx.State:
    """NamedShardings (same tree as `state`) from its variables' logical axis names.

    Raises ValueError naming the parameter when a dimension is not divisible by its mesh axes.
    """
    def sharding(path, names, value):
        spec = logical_spec(tuple(names), rules)
        for dim, axes in zip(value.shape, spec):
            size = axis_size(mesh.shape, axes)
            if dim % size:
                raise ValueError(f"parameter {jax.tree_util.keystr(path)} of shape {value.shape}: "
                                 f"dimension {dim} is not divisible by mesh axes {axes} ({size} "
                                 f"devices); change sharding.rules or the mesh")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, nnx.get_partition_spec(state), state)


_ACTIVE: list[tuple[jax.sharding.Mesh, Rules]] = []


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES):
    """Within this context models trace with `mesh` and `rules`: the kernels run per shard
    (`per_shard`) and flax's logical axis rules are set."""
    check_rules(rules, mesh.axis_names)
    _ACTIVE.append((mesh, tuple(rules)))
    try:
        with jax.set_mesh(mesh), spmd.logical_axis_rules(tuple(rules)):
            yield mesh
    finally:
        _ACTIVE.pop()


def active_mesh() -> tuple[jax.sharding.Mesh, Rules] | None:
    """The (mesh, rules) of the innermost `use_mesh`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def per_shard(fn: Callable, in_names, out_names) -> Callable:
    """fn run once per shard with `jax.shard_map` when a mesh is active, else fn itself.

    in_names / out_names: pytrees (matching fn's positional arguments / its output) of tuples of
    logical axis names, one per array axis (e.g. ("batch", None, "heads", None)); None leaves
    for arguments that are None. Used for the Pallas kernels, which XLA cannot partition.
    """
    active = active_mesh()
    if active is None:
        return fn
    mesh, rules = active
    is_names = lambda x: isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)
    to_spec = lambda tree: jax.tree.map(lambda n: logical_spec(n, rules), tree, is_leaf=is_names)
    return jax.shard_map(fn, mesh=mesh, in_specs=to_spec(in_names), out_specs=to_spec(out_names),
                         check_vma=False)
