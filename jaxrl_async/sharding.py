"""Meshes and the per-role logical -> mesh axis rules.

Every array dimension carries a logical name ("embed", "vocab", "q_heads", "batch", ...). A role's rules
table maps each logical name to one mesh axis or to None (replicated). The trainer shards over
("fsdp", "tensor"), the sampler over ("data", "tensor").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Rules:
    """A logical-axis -> mesh-axis table for one role.

    Attributes:
      name: the role ("trainer", "sampler").
      mesh_axes: the mesh axis names this role's mesh must have (at most 3).
      mapping: (logical axis, mesh axis or None) pairs; logical axes missing from it are replicated.
    """

    name: str
    mesh_axes: tuple[str, ...]
    mapping: tuple[tuple[str, str | None], ...]

    def __post_init__(self):
        if len(self.mesh_axes) > 3:
            raise ValueError(f"rules {self.name!r}: at most 3 mesh axes, got {self.mesh_axes}")
        seen = set()
        for logical, mesh_axis in self.mapping:
            if logical in seen:
                raise ValueError(f"rules {self.name!r}: logical axis {logical!r} mapped twice")
            seen.add(logical)
            if mesh_axis is not None and mesh_axis not in self.mesh_axes:
                raise ValueError(f"rules {self.name!r}: {logical!r} -> unknown mesh axis {mesh_axis!r}")

    def mesh_sizes(self, mesh_shape: Sequence[int]) -> dict[str, int]:
        """{mesh axis: size} of this role's mesh of `mesh_shape`, e.g. a config's (data, tensor)."""
        return dict(zip(self.mesh_axes, mesh_shape, strict=True))

    def placement(
        self,
        logical_axes: Sequence[str | None],
        shape: Sequence[int] | None = None,
        mesh_sizes: Mapping[str, int] | None = None,
    ) -> tuple[str | None, ...]:
        """The mesh axis of each dimension of an array with these logical axes (None: replicated).

        With `shape` and `mesh_sizes`, a dimension that its mesh axis does not divide is replicated instead
        (e.g. 2 KV heads on a tensor axis of 4): JAX needs even shards. The one place that decides it: the
        shardings (`spec`) and the plan check's per-device bytes (`local_shape`) both come from here.

        Raises:
          ValueError: two dimensions of one array map to the same mesh axis.
        """
        table = dict(self.mapping)
        out, used = [], {}
        for i, logical in enumerate(logical_axes):
            mesh_axis = table.get(logical) if logical is not None else None
            if mesh_axis is not None and shape is not None and mesh_sizes is not None:
                if not _divides(mesh_sizes[mesh_axis], shape[i]):
                    mesh_axis = None
            if mesh_axis is not None:
                if mesh_axis in used:
                    raise ValueError(
                        f"rules {self.name!r}: logical axes {used[mesh_axis]!r} and {logical!r} of one array "
                        f"both map to mesh axis {mesh_axis!r}"
                    )
                used[mesh_axis] = logical
            out.append(mesh_axis)
        return tuple(out)

    def spec(
        self,
        logical_axes: Sequence[str | None],
        shape: Sequence[int] | None = None,
        mesh: Mesh | None = None,
    ) -> PartitionSpec:
        """PartitionSpec for an array with these logical axes (`placement`; with `shape` and `mesh`, a
        dimension the mesh axis does not divide is replicated)."""
        return PartitionSpec(*self.placement(logical_axes, shape, None if mesh is None else mesh.shape))

    def local_shape(
        self, logical_axes: Sequence[str | None], shape: Sequence[int], mesh_sizes: Mapping[str, int]
    ) -> tuple[int, ...]:
        """Each device's block of an array of `shape` on a mesh of `mesh_sizes` (what `spec` gives it)."""
        axes = self.placement(logical_axes, shape, mesh_sizes)
        return tuple(d if a is None else d // mesh_sizes[a] for d, a in zip(shape, axes, strict=True))

    def sharding(self, mesh: Mesh, logical_axes, shape=None) -> NamedSharding:
        """NamedSharding on `mesh` for an array with these logical axes."""
        missing = [a for a in self.mesh_axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"rules {self.name!r} need mesh axes {self.mesh_axes}, mesh has {mesh.axis_names}"
            )
        return NamedSharding(mesh, self.spec(logical_axes, shape, mesh))

    def fallbacks(self, specs_tree, mesh_sizes: Mapping[str, int]) -> list[dict]:
        """The dimensions of `specs_tree`'s leaves (objects with `.shape` and `.logical_axes`) that these
        rules map to a mesh axis which does not divide them, so `spec` replicates them over that axis: each
        {"leaf", "logical", "dim", "mesh_axis", "axis_size"}. Right for 2 KV heads on a tensor axis of 4,
        but it can also hide a mis-sharded layout, so `plan_check` lists them."""
        table = dict(self.mapping)
        out = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(specs_tree, is_leaf=_has_axes):
            for dim, logical in zip(leaf.shape, leaf.logical_axes, strict=True):
                mesh_axis = table.get(logical) if logical is not None else None
                if mesh_axis is not None and not _divides(mesh_sizes[mesh_axis], dim):
                    out.append({"leaf": jax.tree_util.keystr(path, simple=True, separator="/"),
                                "logical": logical, "dim": int(dim), "mesh_axis": mesh_axis,
                                "axis_size": int(mesh_sizes[mesh_axis])})  # fmt: skip
        return out


def _divides(axis_size: int, dim: int) -> bool:
    return dim % axis_size == 0


def _has_axes(x) -> bool:
    return hasattr(x, "logical_axes")


# Trainer: FSDP shards parameters' embed dim and the batch; tensor parallel shards heads, MLP and vocab.
TRAINER_RULES = Rules(
    name="trainer",
    mesh_axes=("fsdp", "tensor"),
    mapping=(
        ("batch", "fsdp"),
        ("embed", "fsdp"),
        ("vocab", "tensor"),
        ("q_heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("layers", None),
        ("head_dim", None),
        ("seq", None),
    ),
)

# Sampler: weights replicated over the data axis (each data shard decodes its own slots), tensor parallel
# inside; the KV cache is sharded by slot (batch) and KV head.
SAMPLER_RULES = Rules(
    name="sampler",
    mesh_axes=("data", "tensor"),
    mapping=(
        ("batch", "data"),
        ("embed", None),
        ("vocab", "tensor"),
        ("q_heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("layers", None),
        ("head_dim", None),
        ("seq", None),
    ),
)

ROLE_RULES = {"trainer": TRAINER_RULES, "sampler": SAMPLER_RULES}


def rules_for(mesh: Mesh) -> Rules:
    """The role rules whose mesh axes are `mesh`'s (the trainer's or the sampler's)."""
    for rules in ROLE_RULES.values():
        if tuple(rules.mesh_axes) == tuple(mesh.axis_names):
            return rules
    raise ValueError(f"no role rules for a mesh with axes {mesh.axis_names}")


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices: Sequence | None = None) -> Mesh:
    """A mesh of `shape` over `devices` (default: all devices, in order).

    Raises:
      ValueError: the device count does not match the shape.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = int(np.prod(shape))
    if n != len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {n} devices, got {len(devices)}")
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {tuple(shape)} and axis names {tuple(axis_names)} differ in length")
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape)), tuple(axis_names))


def tree_shardings(specs_tree, mesh: Mesh, rules: Rules):
    """NamedShardings for a pytree of objects with `.shape` and `.logical_axes` (e.g. ParamSpec)."""
    sharding = lambda s: rules.sharding(mesh, s.logical_axes, s.shape)  # noqa: E731
    return jax.tree.map(sharding, specs_tree, is_leaf=_has_axes)
