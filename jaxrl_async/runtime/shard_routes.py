"""Device-to-device resharding between two meshes in one process, shard by shard.

`jax.device_put(x, target)` between meshes on different devices is served by
`jax._src.array.shard_sharded_device_array_slow_path`: when a target shard's slice is not one of the
source shards' slices (fsdp rows -> tensor columns, say), it falls back to `x._value`, a full host copy of
the array, and re-uploads it. `ShardRoutes` never makes that copy. For every target device it knows the
block of each leaf it must hold and which source shards overlap that block; a sync is then

  1. one jitted call per source device: cut each overlap out of the local shard and cast it to the
     target dtype (the cast happens once, on the source, so only the target's bytes move);
  2. one batched `jax.device_put` of those pieces to their target devices (device to device);
  3. per target device whose blocks are made of several pieces, one jitted call that places them into
     the block; blocks made of one piece are used as they arrive;
  4. `jax.make_array_from_single_device_arrays` per leaf, in the target sharding.

No device holds more of a leaf than its own target block (plus, on the source, the pieces it sends), and
no step reads an array on the host. The routes are derived once per (shapes, source shardings) from
`Sharding.devices_indices_map`, so they hold for any pair of meshes (disjoint or shared devices, any
axis sizes, replicated targets).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

Block = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def _block(index: tuple, shape: tuple) -> Block:
    return tuple((s.start or 0, shape[i] if s.stop is None else s.stop) for i, s in enumerate(index))


def _overlap(a: Block, b: Block) -> Block | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _local(block: Block, within: Block) -> tuple[slice, ...]:
    """`block` as slices of the array that holds `within`."""
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(block, within, strict=True))


@dataclasses.dataclass(frozen=True)
class _Piece:
    leaf: int
    src_device: object
    src_slices: tuple[slice, ...]  # within the source shard
    dst_device: object
    dst_slices: tuple[slice, ...]  # within the target block
    whole: bool  # the piece is its source shard entire


class ShardRoutes:
    """The pieces that carry every leaf from `src` shardings to `dst` shardings (see the module docstring).

    Args:
      shapes: the leaves' global shapes.
      src, dst: the leaves' source and target shardings (flat lists, same order).
      dtype: the target dtype (the cast runs on the source devices), or None to keep each leaf's.
    """

    def __init__(self, shapes: list[tuple], src: list, dst: list, dtype=None):
        self.shapes, self.src, self.dst, self.dtype = [tuple(s) for s in shapes], list(src), list(dst), dtype
        self.pieces: list[_Piece] = []
        self.blocks: list[dict] = []  # per leaf: target device -> its block
        load: dict = {}  # source device -> pieces it sends (replicated sources share the work)
        for leaf, (shape, s, d) in enumerate(zip(self.shapes, src, dst, strict=True)):
            owners: dict[Block, list] = {}
            for dev, ix in s.devices_indices_map(shape).items():
                owners.setdefault(_block(ix, shape), []).append(dev)
            targets = {dev: _block(ix, shape) for dev, ix in d.devices_indices_map(shape).items()}
            self.blocks.append(targets)
            for dev, want in targets.items():
                for have, holders in owners.items():
                    part = _overlap(have, want)
                    if part is None:
                        continue
                    # The holder on the target device itself if there is one (no copy), else the least
                    # loaded replica.
                    src_dev = dev if dev in holders else min(holders, key=lambda h: load.get(h, 0))
                    load[src_dev] = load.get(src_dev, 0) + 1
                    piece = _Piece(leaf, src_dev, _local(part, have), dev, _local(part, want), part == have)
                    self.pieces.append(piece)
        self._cuts: dict = {}  # source dtypes -> (per source device: (piece indices, jitted cut))
        self._place: dict = {}

    def _cuts_for(self, dtypes: tuple) -> dict:
        """The pieces to cut per source device. A whole shard going to another device in its own dtype is
        not cut: `device_put` copies it device to device into a fresh buffer already."""
        if dtypes not in self._cuts:
            cut = [i for i, p in enumerate(self.pieces) if not (
                p.whole and p.src_device != p.dst_device
                and (self.dtype is None or jnp.dtype(self.dtype) == dtypes[p.leaf]))]  # fmt: skip
            device = lambda i: self.pieces[i].src_device
            ordered = sorted(cut, key=lambda i: device(i).id)
            by_src = {k: list(g) for k, g in itertools.groupby(ordered, key=device)}
            self._cuts[dtypes] = {dev: (idx, self._cut_fn(idx)) for dev, idx in by_src.items()}
        return self._cuts[dtypes]

    @property
    def bytes_moved(self) -> int:
        """Bytes that leave their source device per sync (pieces already on their target excluded)."""
        out = 0
        for p in self.pieces:
            if p.src_device != p.dst_device:
                n = 1
                for s in p.src_slices:
                    n *= s.stop - s.start
                out += n * self._leaf_dtype(p.leaf).itemsize
        return out

    def _leaf_dtype(self, leaf: int):
        return jnp.dtype(self.dtype) if self.dtype is not None else jnp.dtype(self._src_dtypes[leaf])

    def _cut_fn(self, idx: list[int]):
        return cut_fn([self.pieces[i].src_slices for i in idx], self.dtype)

    def _place_fn(self, dev, leaves: tuple[int, ...]):
        """One jitted call on `dev` that lays the pieces of every leaf in `leaves` into its block."""
        key = (dev, leaves)
        if key not in self._place:
            plan = []
            for leaf in leaves:
                shape = tuple(hi - lo for lo, hi in self.blocks[leaf][dev])
                where = [p.dst_slices for p in self.pieces if p.leaf == leaf and p.dst_device == dev]
                plan.append((shape, self._leaf_dtype(leaf), where))
            self._place[key] = place_fn(plan)
        return self._place[key]

    def lower_for(self, src_dtypes: list, platforms: tuple[str, ...]) -> dict:
        """Every program a sync of leaves of `src_dtypes` runs (each source device's cut, each target device's
        placement), lowered for `platforms` (e.g. ("tpu",)) on abstract shards: nothing is compiled or
        moved (tests/test_lowering.py). Keys: "cut <device id>", "place <device id>"."""
        self._src_dtypes = [jnp.dtype(d) for d in src_dtypes]
        on = lambda shape, dtype, dev: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))
        out = {}
        for dev, (idx, cut) in self._cuts_for(tuple(self._src_dtypes)).items():
            shards = [on(self.src[p.leaf].shard_shape(self.shapes[p.leaf]), self._src_dtypes[p.leaf], dev)
                      for p in (self.pieces[i] for i in idx)]  # fmt: skip
            out[f"cut {dev.id}"] = cut.trace(shards).lower(lowering_platforms=platforms)
        joins: dict = {}
        for p in self.pieces:
            joins.setdefault((p.dst_device, p.leaf), []).append(p)
        by_dev: dict = {}
        for (dev, leaf), pieces in joins.items():
            if len(pieces) > 1:
                by_dev.setdefault(dev, []).append(leaf)
        for dev, leaves in by_dev.items():
            parts = [[on(tuple(s.stop - s.start for s in p.dst_slices), self._leaf_dtype(leaf), dev)
                      for p in joins[(dev, leaf)]] for leaf in leaves]  # fmt: skip
            place = self._place_fn(dev, tuple(leaves))
            out[f"place {dev.id}"] = place.trace(parts).lower(lowering_platforms=platforms)
        return out

    def __call__(self, leaves: list) -> list:
        """The leaves (global arrays in the source shardings) in the target shardings."""
        self._src_dtypes = [x.dtype for x in leaves]
        shard_of = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
        moved: list = [shard_of[p.leaf][p.src_device] for p in self.pieces]  # whole shards, uncut
        for idx, cut in self._cuts_for(tuple(self._src_dtypes)).values():
            for i, a in zip(idx, cut([moved[i] for i in idx]), strict=True):
                moved[i] = a
        arrived = jax.device_put(moved, [p.dst_device for p in self.pieces])
        parts: dict = {}
        for p, a in zip(self.pieces, arrived, strict=True):
            parts.setdefault((p.leaf, p.dst_device), []).append(a)
        blocks: dict = {}  # (leaf, device) -> the block
        for (leaf, dev), got in parts.items():
            if len(got) == 1:
                blocks[(leaf, dev)] = got[0]
        joins: dict = {}
        for (leaf, dev), got in parts.items():
            if len(got) > 1:
                joins.setdefault(dev, []).append(leaf)
        for dev, leaves_here in joins.items():
            placed = self._place_fn(dev, tuple(leaves_here))([parts[(leaf, dev)] for leaf in leaves_here])
            blocks.update({(leaf, dev): b for leaf, b in zip(leaves_here, placed, strict=True)})
        return [
            jax.make_array_from_single_device_arrays(
                shape, sharding, [blocks[(leaf, dev)] for dev in self.blocks[leaf]]
            )
            for leaf, (shape, sharding) in enumerate(zip(self.shapes, self.dst, strict=True))
        ]


def cut_fn(slices: list[tuple[slice, ...]], dtype=None):
    """A jitted function of a list of arrays (on one device) -> each cut to its slices and cast to
    `dtype`, always into a fresh buffer (the trainer's next step donates its shards)."""

    def cut(shards):
        out = []
        for x, sl in zip(shards, slices, strict=True):
            y = x[sl]
            out.append(jnp.copy(y) if dtype is None or y.dtype == jnp.dtype(dtype) else y.astype(dtype))
        return out

    return jax.jit(cut)


def place_fn(plan: list[tuple[tuple, object, list]]):
    """A jitted function laying pieces into blocks on one device; `plan` per block: (shape, dtype, the
    pieces' slices within it), the argument per block: the pieces in that order."""

    def place(parts_per_block):
        return [_tile(list(zip(where, parts, strict=True)), 0) for (_, _, where), parts in
                zip(plan, parts_per_block, strict=True)]  # fmt: skip

    return jax.jit(place)


def _tile(pieces: list, dim: int):
    """The block from pieces that tile it as a grid (both layouts are regular tilings): concatenated
    dimension by dimension, so every element is written once (no zero fill, no update in place)."""
    if len(pieces) == 1:
        return pieces[0][1]
    rows: dict[int, list] = {}
    for sl, a in pieces:
        rows.setdefault(sl[dim].start, []).append((sl, a))
    if len(rows) == 1:
        return _tile(pieces, dim + 1)
    return jnp.concatenate([_tile(rows[k], dim + 1) for k in sorted(rows)], axis=dim)


def distinct_blocks(sharding, shape: tuple) -> dict[Block, list]:
    """Each distinct block of an array of `shape` under `sharding` -> the devices that hold it."""
    out: dict[Block, list] = {}
    for dev, ix in sharding.devices_indices_map(tuple(shape)).items():
        out.setdefault(_block(ix, tuple(shape)), []).append(dev)
    return out


def overlap(a: Block, b: Block) -> Block | None:
    """The intersection of two blocks (None when empty)."""
    return _overlap(a, b)


def local_slices(block: Block, within: Block) -> tuple[slice, ...]:
    """`block` as slices of the array that holds `within`."""
    return _local(block, within)


def local_blocks(shardings: list, shapes: list, pid: int) -> set:
    """(leaf, block) of every distinct block of `shardings` (one per leaf, of the leaf's shape in
    `shapes`) that a device of process `pid` holds."""
    return {
        (leaf, block)
        for leaf, (sh, shape) in enumerate(zip(shardings, shapes, strict=True))
        for block, devs in distinct_blocks(sh, shape).items()
        if any(d.process_index == pid for d in devs)
    }
