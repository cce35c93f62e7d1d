"""Trainer -> sampler weights: resharded into the sampler layout after every train step, versioned.

* One process (`LocalWeights`): shard by shard from the trainer mesh into the sampler's shardings,
  device to device (`WeightSync`, `shard_routes.ShardRoutes`).
* Several processes (`TransferPublisher` on every trainer process, `TransferReceiver` on every actor):
  `jax.experimental.transfer`. Each trainer process casts its shards to the sampler dtype (a fresh copy:
  the next train step donates the state) and offers every *distinct* shard it owns for one pull per actor;
  the actor pulls all shards into its first device, joins them and reshards locally.

Why the transfer server and not a cross-process `jax.device_put`: `device_put` across processes is a
collective point (both sides must enter it together, only between same-spec shardings, and a sender that
enters another collective while the receiver still waits deadlocks), which would make the trainer wait for
the sampler every step. A pull lets the trainer offer a version and go on training; the actor takes it
between decode calls. `tools/bench_transport.py` measures both against a local copy of the same bytes.
"""

from __future__ import annotations

import datetime
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxrl_async.model import ModelConfig, abstract_params, param_shardings
from jaxrl_async.model.config import DTYPES
from jaxrl_async.runtime.shard_routes import ShardRoutes
from jaxrl_async.runtime.transport import NewWeights
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, Rules

_MAX_ACTORS = 4096  # pull ids: version * _MAX_ACTORS + actor


@jax.jit
def _checksum(tree):
    """Position-weighted float32 sum of every weight: a permutation or a changed value moves it."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        w = (jax.lax.iota(jnp.int32, x.size) % 127 + 1).astype(jnp.float32).reshape(x.shape)
        total = total + jnp.sum(x.astype(jnp.float32) * w)
    return total


def checksum(params) -> float:
    """`_checksum` read back: equal weights give equal sums up to float32 rounding (compare with rtol).
    Every process holding shards of `params` must call it (it is one SPMD computation)."""
    out = _checksum(params)
    return float(np.asarray(out.addressable_shards[0].data))


class WeightSync:
    """Moves parameters onto the sampler mesh into the sampler's layout, device to device.

    The target shardings derive from the same parameter declaration as the trainer's, so the two layouts
    always describe one tree. With `dtype` (e.g. "bfloat16" from float32 master weights) the cast runs
    once, on the trainer's devices, before the transfer, so only the sampler's bytes move; `sampler_cfg`
    is then the model config whose parameter layout the copy has (give it to the sampler's Engine).
    The copy goes shard by shard (`shard_routes.ShardRoutes`): a plain `jax.device_put` between the
    meshes reads a whole leaf back to the host whenever a sampler shard is not one of the trainer's
    shards (fsdp rows -> tensor columns). The copy never shares a buffer with the trainer's parameters
    (the train step donates those), also when both roles sit on the same devices.
    """

    def __init__(
        self, cfg: ModelConfig, sampler_mesh, rules: Rules = SAMPLER_RULES, dtype: str | None = None
    ):
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"WeightSync: dtype={dtype!r} not in {DTYPES} (or None: keep the trainer's)")
        self.shardings = param_shardings(cfg, sampler_mesh, rules)
        self.dtype = dtype  # e.g. "bfloat16" to sample in bf16 from fp32 master weights
        self.sampler_cfg = cfg if dtype is None else cfg.replace(param_dtype=dtype)
        self._routes: dict = {}  # source shardings -> ShardRoutes
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self.count = 0

    def routes_for(self, trainer_params: dict) -> ShardRoutes:
        """The shard routes from `trainer_params`' layout (built once per layout)."""
        leaves, treedef = jax.tree.flatten(trainer_params)
        key = (treedef, tuple((x.shape, x.sharding) for x in leaves))
        if key not in self._routes:
            dst = treedef.flatten_up_to(self.shardings)
            self._routes[key] = ShardRoutes([x.shape for x in leaves], [x.sharding for x in leaves], dst,
                                            self.dtype)  # fmt: skip
        return self._routes[key]

    def __call__(self, trainer_params: dict, wait: bool = True) -> dict:
        """Returns the sampler's copy. With `wait` it blocks until the copy has arrived (the timing is the
        transfer's); without, it returns once the copy is dispatched (the timing is what the caller was
        held): the sampler's next call and the trainer's next step are ordered after it by JAX, so nothing
        reads a half-written copy and the donation of the trainer's buffers waits for the copy's reads."""
        t0 = time.perf_counter()
        leaves, treedef = jax.tree.flatten(trainer_params)
        out = jax.tree.unflatten(treedef, self.routes_for(trainer_params)(leaves))
        if wait:
            jax.block_until_ready(out)
        self.last_seconds = time.perf_counter() - t0
        self.total_seconds += self.last_seconds
        self.count += 1
        return out


class LocalWeights:
    """One process: the published message carries the sampler-layout arrays themselves.

    The sync is dispatched, not waited for (`WeightSync(wait=False)`): no host read of the event loop
    waits for the copy, so the trainer's next step and the sampler's next decode call are dispatched at
    once and the copy runs on the devices between them. `last_seconds` is then the trainer's stall (the
    dispatch), not the transfer (`tools/bench_sync_one_process.py` times the transfer).
    """

    def __init__(self, sync: WeightSync, verify: bool = False):
        self.sync, self.verify = sync, verify

    @property
    def last_seconds(self) -> float:
        return self.sync.last_seconds

    def publish(self, version: int, params) -> NewWeights:
        out = self.sync(params, wait=False)
        return NewWeights(version, out, checksum(out) if self.verify else None)

    def receive(self, message: NewWeights):
        return message.params


def _owned_shards(shardings: list, shapes: list) -> list[list[tuple[int, tuple, object]]]:
    """Per leaf: (owner process, index, owner device) of every distinct shard (replicas are taken once,
    from the first device that holds them)."""
    plan = []
    for sh, shape in zip(shardings, shapes, strict=True):
        seen, leaf = set(), []
        for device, index in sh.devices_indices_map(shape).items():
            key = tuple((s.start, s.stop) for s in index)
            if key not in seen:
                seen.add(key)
                leaf.append((device.process_index, index, device))
        plan.append(leaf)
    return plan


def _norm(index: tuple, shape: tuple) -> tuple[slice, ...]:
    return tuple(slice(s.start or 0, shape[i] if s.stop is None else s.stop) for i, s in enumerate(index))


class _ShardPlan:
    """Which trainer process offers which shard of which leaf; derived identically on both sides from
    the model declaration and the trainer mesh (no message carries it)."""

    def __init__(self, model_cfg: ModelConfig, trainer_mesh, dtype):
        specs = abstract_params(model_cfg)
        leaves, self.treedef = jax.tree.flatten(specs)
        shardings = jax.tree.leaves(param_shardings(model_cfg, trainer_mesh, TRAINER_RULES))
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtype = jnp.dtype(dtype)
        self.trainer_shardings = shardings
        self.plan = _owned_shards(shardings, self.shapes)
        self.processes = sorted({p for leaf in self.plan for p, _, _ in leaf})

    def offered_by(self, pid: int) -> list[tuple[int, tuple, object]]:
        """(leaf, index, device) of the shards process `pid` offers, in pull order."""
        return [(i, ix, dev) for i, leaf in enumerate(self.plan) for p, ix, dev in leaf if p == pid]


class TransferPublisher:
    """Trainer side: offers each version's shards to every actor (see the module docstring).

    Every trainer process must call `publish` for every version, in the same order as its train steps.
    """

    def __init__(self, cluster, model_cfg: ModelConfig, trainer_mesh, dtype, num_actors: int, verify=False):
        from jax.experimental import transfer

        self.pid, self.num_actors, self.verify = cluster.process_id, num_actors, verify
        self.plan = _ShardPlan(model_cfg, trainer_mesh, dtype)
        self.mine = self.plan.offered_by(self.pid)
        self.server = transfer.start_transfer_server(
            jax.local_devices()[0].client, f"{cluster.host}:0", [f"{cluster.host}:0"]
        )
        cluster.publish(f"transfer/{self.pid}", self.server.address())
        shardings = jax.tree.unflatten(self.plan.treedef, self.plan.trainer_shardings)
        self._cast = jax.jit(
            lambda p: jax.tree.map(lambda x: x.astype(self.plan.dtype), p), out_shardings=shardings
        )
        self._offered: dict[int, list] = {}  # version -> the arrays offered (kept until two versions on)
        self.last_seconds = 0.0

    def publish(self, version: int, params) -> NewWeights:
        """Offers `params` (trainer layout) as `version`; returns the message for the actors."""
        t0 = time.perf_counter()
        transit = jax.tree.leaves(self._cast(params))
        arrays = []
        for leaf, _, device in self.mine:
            shard = next(s for s in transit[leaf].addressable_shards if s.device == device)
            arrays.append(shard.data)
        jax.block_until_ready(arrays)
        for actor in range(self.num_actors):
            if arrays:
                self.server.await_pull(version * _MAX_ACTORS + actor, arrays)
        self._offered[version] = arrays
        self._offered.pop(version - 2, None)
        total = checksum(jax.tree.unflatten(self.plan.treedef, transit)) if self.verify else None
        self.last_seconds = time.perf_counter() - t0
        return NewWeights(version, None, total)


class TransferReceiver:
    """Actor side: pulls every shard of a version from the trainer processes and lays it out for the
    sampler mesh."""

    def __init__(self, cluster, actor: int, model_cfg: ModelConfig, trainer_mesh, sampler_mesh, dtype,
                 timeout_s: float = 300.0):  # fmt: skip
        from jax.experimental import transfer

        self.actor, self.timeout_s = actor, timeout_s
        self.plan = _ShardPlan(model_cfg, trainer_mesh, dtype)
        self.device = sampler_mesh.devices.flat[0]
        self.server = transfer.start_transfer_server(
            self.device.client, f"{cluster.host}:0", [f"{cluster.host}:0"]
        )
        self.conns = {p: self.server.connect(cluster.lookup(f"transfer/{p}")) for p in self.plan.processes}
        self.target = param_shardings(model_cfg, sampler_mesh, SAMPLER_RULES)
        self.last_seconds, self.last_bytes = 0.0, 0

    def receive(self, message: NewWeights):
        """The sampler-layout params of `message.version` (blocks until every shard has arrived)."""
        t0 = time.perf_counter()
        plan, uuid = self.plan, message.version * _MAX_ACTORS + self.actor
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        pieces: list[list] = [[] for _ in plan.shapes]
        for p in plan.processes:
            offered = plan.offered_by(p)
            here = SingleDeviceSharding(self.device)
            specs = [
                jax.ShapeDtypeStruct(
                    tuple(s.stop - s.start for s in _norm(ix, plan.shapes[leaf])), plan.dtype, sharding=here
                )
                for leaf, ix, _ in offered
            ]
            arrays = self.conns[p].pull(uuid, specs, timeout=deadline)
            for (leaf, ix, _), a in zip(offered, arrays, strict=True):
                pieces[leaf].append((_norm(ix, plan.shapes[leaf]), a))
        leaves = [
            parts[0][1] if len(parts) == 1 else _join(plan.shapes[i], plan.dtype, parts)
            for i, parts in enumerate(pieces)
        ]
        out = jax.device_put(jax.tree.unflatten(plan.treedef, leaves), self.target)
        jax.block_until_ready(out)
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(x.nbytes for x in leaves)
        return out


def _join(shape: tuple, dtype, parts: list):
    """One array of `shape` from (index, shard) pieces that tile it."""
    index = tuple(tuple((s.start, s.stop) for s in ix) for ix, _ in parts)
    return _join_fn(tuple(shape), jnp.dtype(dtype), index)(*[a for _, a in parts])


@functools.lru_cache(maxsize=256)
def _join_fn(shape, dtype, index):
    def join(*shards):
        out = jnp.zeros(shape, dtype)
        for ix, a in zip(index, shards, strict=True):
            out = out.at[tuple(slice(b, e) for b, e in ix)].set(a)
        return out

    return jax.jit(join)


def sampler_dtype(model_cfg: ModelConfig) -> str:
    """The dtype the sampler holds: the model's compute dtype (bf16 weights from fp32 masters)."""
    return model_cfg.dtype
