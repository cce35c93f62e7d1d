"""Trainer -> sampler weights: resharded into the sampler layout after every train step, versioned.

* One process (`LocalWeights`): shard by shard from the trainer mesh into the sampler's shardings,
  device to device (`WeightSync`, `shard_routes.ShardRoutes`).
* Several processes (`TransferPublisher` on every trainer process, `TransferReceiver` on every actor):
  `jax.experimental.transfer`, shard to shard. Each version is cut into pieces, the overlaps of the
  distinct trainer shards with the distinct sampler blocks (`_PiecePlan`, derived on both sides from the
  model declaration and the two mesh shapes). Each trainer process cuts and casts its pieces to the
  sampler dtype in one jitted call per device (a fresh copy: the next train step donates the state) and
  offers them for one pull per actor; the actor pulls each piece straight onto the sampler device whose
  block it belongs to and lays the blocks out there. No device holds more than its own blocks.
* Processes of one CPU host (`config.mesh.weight_transport="auto"`): the same pieces, written once per
  version into shared-memory slots and mapped by the receivers in place (`shm_weights`); each receiver
  says which path it took, and the publisher offers transfer pulls only to the others.

Why the transfer server and not a cross-process `jax.device_put`: `device_put` across processes is a
collective point (both sides must enter it together, only between same-spec shardings, and a sender that
enters another collective while the receiver still waits deadlocks), which would make the trainer wait for
the sampler every step. A pull lets the trainer offer a version and go on training; the actor takes it
between decode calls. `benchmarks/bench_transport.py` measures both against a local copy of the same bytes.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxrl_async.model import ModelConfig, param_shardings, param_specs
from jaxrl_async.model.config import DTYPES
from jaxrl_async.model.params import ParamSpec
from jaxrl_async.runtime import shard_routes, shm_weights
from jaxrl_async.runtime.cluster import PeerFailure
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.shard_routes import ShardRoutes
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, Rules, make_mesh, tree_shardings

log = logging.getLogger(__name__)

_MAX_ACTORS = 4096  # pull ids: (version * _MAX_ACTORS + actor) * _MAX_BUCKETS + bucket
_MAX_BUCKETS = 4096
BUCKET_BYTES = 64 << 20  # pieces are offered in buckets of about this many bytes (the last may be smaller)


# config.mesh.weight_transport -> whether processes of one CPU host use shared memory
_TRANSPORTS = {"auto": True, "transfer": False}


def _shared_memory_ok() -> bool:
    """Shared-memory slots serve CPU devices only: on an accelerator a host hop would add two copies."""
    return os.path.isdir(shm_weights.SHM_ROOT) and jax.local_devices()[0].platform == "cpu"


@dataclasses.dataclass(frozen=True)
class Channel:
    """What a `TransferPublisher` / `TransferReceiver` pair moves. The default: the model's parameters,
    every version. A LoRA run (runtime/lora_sync.py) opens two instead: its frozen base, once, and its
    adapters, every version; each channel has cluster keys and shared-memory slots of its own."""

    name: str = ""  # prefix of the channel's cluster keys ("": the model's parameters)
    specs: dict | None = None  # the ParamSpec tree moved; None: the model's (model.param_specs)
    slots: int = shm_weights.MAX_SLOTS  # shared-memory slots (versions held at once); 1 for a one-off

    def key(self, *parts) -> str:  # e.g. "lora:transfer/0"
        return self.name + "/".join(map(str, parts))

    def specs_of(self, model_cfg: ModelConfig) -> dict:
        return param_specs(model_cfg) if self.specs is None else self.specs


def _uuid(version: int, actor: int, bucket: int) -> int:
    return (version * _MAX_ACTORS + actor) * _MAX_BUCKETS + bucket


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
        self, cfg: ModelConfig, sampler_mesh, rules: Rules = SAMPLER_RULES, dtype: str | None = None,
        specs: dict | None = None,
    ):
        """`specs`: the ParamSpec tree moved, when not the model's (a LoRA run's adapters)."""
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"WeightSync: dtype={dtype!r} not in {DTYPES} (or None: keep the trainer's)")
        if specs is None:
            self.shardings = param_shardings(cfg, sampler_mesh, rules)
        else:
            self.shardings = tree_shardings(specs, sampler_mesh, rules)
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


@dataclasses.dataclass
class Incoming:
    """A version on its way to the sampler (`start` of a weight receiver): its message, the pieces pulled
    so far ((leaf, device) -> [(slices in the block, array)]; None in one process), their bytes and the
    seconds `start` took."""

    message: NewWeights
    parts: dict | None
    nbytes: int
    start_s: float = 0.0


class LocalWeights:
    """One process: the published message carries the sampler-layout arrays themselves.

    The sync is dispatched, not waited for (`WeightSync(wait=False)`): no host read of the event loop
    waits for the copy, so the trainer's next step and the sampler's next decode call are dispatched at
    once and the copy runs on the devices between them. `last_seconds` is then the trainer's stall (the
    dispatch), not the transfer (`benchmarks/bench_sync_one_process.py` times the transfer).
    """

    def __init__(self, sync: WeightSync, verify: bool = False):
        self.sync, self.verify = sync, verify
        self.last_bytes = 0  # what the last version moved (perf/weight_sync_bytes)

    @property
    def last_seconds(self) -> float:
        return self.sync.last_seconds

    def publish(self, version: int, params) -> NewWeights:
        out = self.sync(params, wait=False)
        self.last_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))
        return NewWeights(version, out, checksum(out) if self.verify else None)

    def start(self, message: NewWeights) -> Incoming:
        return Incoming(message, None, 0)  # already on the sampler's devices (dispatched)

    def ready(self, incoming: Incoming) -> bool:
        return True

    def finish(self, incoming: Incoming):
        return incoming.message.params

    def receive(self, message: NewWeights):
        return message.params


@dataclasses.dataclass(frozen=True)
class _Offer:
    """One piece of one leaf: the overlap of a trainer shard with a sampler block."""

    leaf: int
    process: int  # the trainer process that cuts and offers it
    device: object  # the trainer device whose shard holds it
    src_slices: tuple  # within that shard
    block: tuple  # the sampler block it belongs to ((start, stop) per dimension)
    dst_slices: tuple  # within the block
    shape: tuple


class _PiecePlan:
    """What each trainer process offers for every version, derived identically on both sides from the
    model declaration, the trainer mesh and the sampler mesh's shape (no message carries it).

    A piece is the overlap of one distinct trainer shard with one distinct sampler block (the sampler
    layout's blocks depend on its mesh shape only), so each sampler device receives exactly the bytes
    of its own blocks, straight from the trainer shards that hold them.
    """

    def __init__(self, specs: dict, trainer_mesh, sampler_shape: tuple, dtype):
        leaves, self.treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtype = jnp.dtype(dtype)
        # what a version moves to one sampler replica (the pieces partition every leaf)
        self.nbytes = sum(int(np.prod(s)) for s in self.shapes) * self.dtype.itemsize
        t_sh = jax.tree.leaves(tree_shardings(specs, trainer_mesh, TRAINER_RULES))
        n = int(np.prod(sampler_shape))
        geometry = make_mesh(tuple(sampler_shape), ("data", "tensor"), jax.devices()[:n])  # indices only
        s_sh = jax.tree.leaves(tree_shardings(specs, geometry, SAMPLER_RULES))
        self.trainer_shardings = t_sh
        self.pieces: list[_Offer] = []
        for leaf, shape in enumerate(self.shapes):
            wanted = sorted(shard_routes.distinct_blocks(s_sh[leaf], shape))
            for have, holders in shard_routes.distinct_blocks(t_sh[leaf], shape).items():
                dev = holders[0]
                for want in wanted:
                    part = shard_routes.overlap(have, want)
                    if part is None:
                        continue
                    src, dst = shard_routes.local_slices(part, have), shard_routes.local_slices(part, want)
                    size = tuple(hi - lo for lo, hi in part)
                    self.pieces.append(_Offer(leaf, dev.process_index, dev, src, want, dst, size))
        self.processes = sorted({p.process for p in self.pieces})

    def offered_by(self, pid: int) -> list[_Offer]:
        """The pieces process `pid` offers, in pull order."""
        return [p for p in self.pieces if p.process == pid]

    def buckets(self, pid: int, bucket_bytes: int) -> list[list[_Offer]]:
        """Process `pid`'s pieces in pull order, cut into buckets of about `bucket_bytes` (a piece is
        never split; one larger than a bucket is a bucket of its own)."""
        out: list[list[_Offer]] = [[]]
        size = 0
        for p in self.offered_by(pid):
            n = int(np.prod(p.shape)) * self.dtype.itemsize
            if out[-1] and size + n > bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += n
        if len(out) > _MAX_BUCKETS:
            raise ValueError(f"{len(out)} buckets of {bucket_bytes} bytes: more than {_MAX_BUCKETS}")
        return out if out[0] else []


class TransferPublisher:
    """Trainer side: offers each version's pieces to every actor (see the module docstring).

    Every trainer process must call `publish` for every version, in the same order as its train steps.

    Args:
      num_actors: pulls per version: one per sampler process (a replica that spans processes takes one per
        member).
      targets: pull -> (its replica's sampler mesh, the member's process id) for the members of replicas
        that span processes: such a pull takes only the pieces whose block a device of that member holds
        (`shard_routes.local_blocks`); the other pulls take every piece.
      channel: what moves (`Channel`; default the model's parameters).

    Attributes:
      last_bytes: what a version moves to each sampler replica (perf/weight_sync_bytes).
    """

    def __init__(self, cluster, model_cfg: ModelConfig, trainer_mesh, sampler_shape, dtype, num_actors: int,
                 verify=False, bucket_bytes: int = BUCKET_BYTES, targets: dict | None = None,
                 transport: str = "auto", channel: Channel = Channel()):  # fmt: skip
        from jax.experimental import transfer

        self.pid, self.num_actors, self.verify = cluster.process_id, num_actors, verify
        self.cluster, self.channel = cluster, channel
        specs = channel.specs_of(model_cfg)
        self.plan = _PiecePlan(specs, trainer_mesh, sampler_shape, dtype)
        self.buckets = self.plan.buckets(self.pid, bucket_bytes)
        # pull -> per bucket, the positions of the pieces it takes (absent: all of them)
        self._takes: dict[int, list[list[int]]] = {}
        for pull, (mesh, member) in (targets or {}).items():
            s_sh = jax.tree.leaves(tree_shardings(specs, mesh, SAMPLER_RULES))
            mine = shard_routes.local_blocks(s_sh, self.plan.shapes, member)
            self._takes[pull] = [
                [i for i, o in enumerate(bucket) if (o.leaf, o.block) in mine] for bucket in self.buckets
            ]
        self.server = transfer.start_transfer_server(
            jax.local_devices()[0].client, f"{cluster.host}:0", [f"{cluster.host}:0"]
        )
        cluster.publish(channel.key("transfer", self.pid), self.server.address())
        # Readers on this host take the versions from shared memory (config.mesh.weight_transport="auto").
        # A process that offers no piece (its shards are all replicas of blocks another process cuts, e.g.
        # a dimension the fsdp axis does not divide) has no slots: no receiver reads from it (both sides
        # derive `_PiecePlan.processes`), so none says how it would.
        self.writer = None
        if _TRANSPORTS[transport] and _shared_memory_ok() and self.pid in self.plan.processes:
            shapes = [o.shape for o in self.plan.offered_by(self.pid)]
            self.writer = shm_weights.SlotWriter(
                shapes, self.plan.dtype, num_actors, [], max_slots=channel.slots, check=cluster.check_peers
            )
        where = f"{shm_weights.host_key()}|{self.writer.directory}" if self.writer else ""
        cluster.publish(channel.key("weights_shm", self.pid), where)
        self._shm_pulls: list[int] | None = None  # the pulls that read the slots (`resolve_paths`)
        # Per bucket, one jitted cut + cast per local trainer device: the cast happens once, on the trainer,
        # only the pieces' bytes are written, and a bucket can be pulled as soon as its own cut is done.
        self._cuts = []
        for bucket in self.buckets:
            by_device: dict = {}
            for i, p in enumerate(bucket):
                by_device.setdefault(p.device, []).append(i)
            dtype = self.plan.dtype
            self._cuts.append([(dev, idx, shard_routes.cut_fn([bucket[i].src_slices for i in idx], dtype))
                               for dev, idx in by_device.items()])  # fmt: skip
        shardings = jax.tree.unflatten(self.plan.treedef, self.plan.trainer_shardings)
        self._cast = jax.jit(
            lambda p: jax.tree.map(lambda x: x.astype(self.plan.dtype), p), out_shardings=shardings
        )
        bits = jnp.dtype(f"uint{self.plan.dtype.itemsize * 8}")
        # in the trainer's shardings: `_write` reads the bits shard by shard, on the trainer's devices
        self._bits = jax.jit(lambda p: jax.tree.map(
            lambda x: jax.lax.bitcast_convert_type(x.astype(self.plan.dtype), bits), p),
            out_shardings=shardings)  # fmt: skip
        self._offered: dict[int, list] = {}  # version -> the arrays offered (kept until two versions on)
        self.last_seconds = 0.0
        self.last_bytes = 0

    def publish(self, version: int, params) -> NewWeights:
        """Offers `params` (trainer layout) as `version`; returns the message for the actors."""
        t0 = time.perf_counter()
        shm = self.resolve_paths()
        if shm:
            self._write(version, params)
        transfer_pulls = [a for a in range(self.num_actors) if a not in shm]
        offered = []
        # Offered as dispatched: a pull of a bucket waits for its cut on the trainer's devices, so the
        # trainer's loop goes on (its next step is ordered after the cuts' reads) while buckets are cut and
        # pulled one after the other.
        leaves = jax.tree.leaves(params)
        for b, (bucket, cuts) in enumerate(zip(self.buckets, self._cuts, strict=True)):
            if not transfer_pulls:
                break
            arrays: list = [None] * len(bucket)
            for dev, idx, cut in cuts:
                shards = [_shard(leaves[bucket[i].leaf], dev) for i in idx]
                for i, a in zip(idx, cut(shards), strict=True):
                    arrays[i] = a
            for actor in transfer_pulls:
                take = self._takes.get(actor)
                offer = arrays if take is None else [arrays[i] for i in take[b]]
                if offer:  # a member whose devices hold none of the bucket's blocks does not pull it
                    self.server.await_pull(_uuid(version, actor, b), offer)
            offered.append(arrays)
        self._offered[version] = offered
        self._offered.pop(version - 2, None)
        total = checksum(self._cast(params)) if self.verify else None
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = self.plan.nbytes
        return NewWeights(version, None, total)

    def release(self, version: int) -> None:
        """Drops this side's hold on `version`'s offered pieces (every pull of it is done)."""
        self._offered.pop(version, None)

    def resolve_paths(self, timeout_s: float = 600.0) -> set[int]:
        """The pulls that read this process's shared-memory slots (each receiver says which path it
        took, once, as it starts: it may not see the slots, e.g. on another host). The first call waits
        up to `timeout_s` for every receiver; call it before the trainer processes' first collective (the
        build does, then meets the other trainer processes at a barrier), so that no trainer process waits
        here while the others have entered a train step.

        Raises:
          PeerFailure: a receiver did not say within `timeout_s` (or a process failed meanwhile).
        """
        if self._shm_pulls is None:
            pulls: list[int] = []
            if self.writer is not None:
                deadline = time.monotonic() + timeout_s
                said = []
                for a in range(self.num_actors):
                    key = self.channel.key("weights_path", self.pid, a)
                    try:
                        said.append(self.cluster.lookup(key, max(deadline - time.monotonic(), 0.0)))
                    except PeerFailure as e:
                        if time.monotonic() < deadline:  # another process failed: its own report
                            raise
                        raise PeerFailure(
                            f"trainer process {self.pid}: pull {a} did not say how it takes this process's "
                            f"weights ({e})"
                        ) from None
                pulls = [a for a, path in enumerate(said) if path == "shm"]
                self.writer.shm_readers = pulls
            self._shm_pulls = pulls
        return set(self._shm_pulls)

    def _write(self, version: int, params) -> None:
        """One copy of this process's pieces into a shared-memory slot, cast to the sampler dtype first
        (once) where the trainer's differs. The copy is made before `publish` returns, so the next train
        step may donate the state; numpy reads the shards in place (dlpack: no host copy, no cached view)."""
        leaves = jax.tree.leaves(params)
        if self.plan.dtype.kind not in "fiu" or any(x.dtype != self.plan.dtype for x in leaves):
            leaves = jax.tree.leaves(self._bits(params))  # numpy reads bfloat16 only as its bits
        jax.block_until_ready(leaves)
        sources = (np.from_dlpack(_shard(leaves[o.leaf], o.device))[o.src_slices]
                   for o in self.plan.offered_by(self.pid))  # fmt: skip
        self.writer.write(version, sources)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _shard(x: jax.Array, device) -> jax.Array:
    return next(s.data for s in x.addressable_shards if s.device == device)


class TransferReceiver:
    """Actor side: pulls each piece of a version straight onto the sampler device whose block it belongs
    to, and lays the blocks out in the sampler layout: no array is joined on one device. A block held by
    several devices of this process (the data axis) is pulled once and copied device to device.

    A member of a replica that spans processes (`actor` is then its pull, `TransferPublisher`'s `targets`)
    pulls only the pieces of the blocks its own devices hold, onto the first of them: no process of the
    replica receives the whole model. `channel`: what moves (`Channel`)."""

    def __init__(self, cluster, actor: int, model_cfg: ModelConfig, trainer_mesh, sampler_mesh, dtype,
                 timeout_s: float = 300.0, bucket_bytes: int = BUCKET_BYTES,
                 transport: str = "auto", channel: Channel = Channel()):  # fmt: skip
        from jax.experimental import transfer

        self.actor, self.timeout_s, self.channel = actor, timeout_s, channel
        pid = cluster.process_id
        specs = channel.specs_of(model_cfg)
        self.plan = _PiecePlan(specs, trainer_mesh, tuple(sampler_mesh.devices.shape), dtype)
        self.target = jax.tree.leaves(tree_shardings(specs, sampler_mesh, SAMPLER_RULES))
        # per leaf: block -> the devices of this process that hold it (none: another member's block)
        self.holders = [
            {b: [d for d in devs if d.process_index == pid] for b, devs in
             shard_routes.distinct_blocks(sh, shape).items()}
            for sh, shape in zip(self.target, self.plan.shapes, strict=True)
        ]  # fmt: skip
        mine = lambda o: bool(self.holders[o.leaf][o.block])
        self.buckets = {p: [[o for o in b if mine(o)] for b in self.plan.buckets(p, bucket_bytes)]
                        for p in self.plan.processes}  # fmt: skip
        local = next(d for d in sampler_mesh.devices.flat if d.process_index == pid)
        self.server = transfer.start_transfer_server(local.client, f"{cluster.host}:0", [f"{cluster.host}:0"])
        # Per trainer process: its shared-memory slots where this process sees them, else the transfer server.
        self.readers: dict[int, tuple[shm_weights.SlotReader, list[int]]] = {}
        self.conns = {}
        for p, buckets in self.buckets.items():
            wanted = [i for i, o in enumerate(self.plan.offered_by(p)) if mine(o)]
            reader = self._reader(cluster, p, pid, dtype) if wanted and _TRANSPORTS[transport] else None
            if reader is not None:
                self.readers[p] = (reader, wanted)
            elif any(buckets):
                self.conns[p] = self.server.connect(cluster.lookup(channel.key("transfer", p)))
            path = "shm" if reader is not None else "transfer"
            cluster.publish(channel.key("weights_path", p, actor), path)
            log.info("pull %d: %sweights from trainer process %d through %s", actor, channel.name, p,
                     f"shared memory ({reader.directory})" if reader else "the transfer server")  # fmt: skip
        self._place: dict = {}
        self.last_seconds, self.last_bytes = 0.0, 0

    def _reader(self, cluster, p: int, pid: int, dtype):
        """A reader of process `p`'s slots if they are on this host and this process is on the CPU."""
        where = cluster.lookup(self.channel.key("weights_shm", p))
        host, _, directory = where.partition("|")
        if not where or host != shm_weights.host_key() or not _shared_memory_ok():
            return None
        if not os.path.isdir(directory):
            return None  # same host name, other memory (e.g. another container)
        if not shm_weights.alive(shm_weights.writer_pid(directory)):
            return None  # the writer's process is not visible from here: its death could not be seen
        shapes = [o.shape for o in self.plan.offered_by(p)]
        return shm_weights.SlotReader(directory, shapes, self.plan.dtype, self.actor,
                                      timeout_s=self.timeout_s, max_slots=self.channel.slots,
                                      check=cluster.check_peers)  # fmt: skip

    def receive(self, message: NewWeights):
        """The sampler-layout params of `message.version` (blocks until every piece has arrived)."""
        return self.finish(self.start(message))

    def start(self, message: NewWeights) -> Incoming:
        """Starts pulling `message.version` and returns at once: the pieces land on the sampler's devices
        while the caller goes on (the actor keeps decoding with the version it has)."""
        t0 = time.perf_counter()
        parts, nbytes = self._guard(message, lambda: self.pull(message))
        return Incoming(message, parts, nbytes, time.perf_counter() - t0)

    def ready(self, incoming: Incoming) -> bool:
        """Whether every piece of `incoming` has landed (`finish` then does not wait for the wire)."""
        arrays = [a for got in incoming.parts.values() for _, a in got]
        return self._guard(incoming.message, lambda: all(a.is_ready() for a in arrays))

    def finish(self, incoming: Incoming):
        """The sampler-layout params of `incoming` (waits for any piece still on its way)."""
        t0 = time.perf_counter()

        def lay_out():
            out = jax.tree.unflatten(self.plan.treedef, self.assemble(incoming.parts))
            return jax.block_until_ready(out)

        out = self._guard(incoming.message, lay_out)
        self.last_seconds = incoming.start_s + time.perf_counter() - t0
        self.last_bytes = incoming.nbytes
        return out

    def _guard(self, message: NewWeights, fn):
        """`fn()`; a pull returns at once, so a sender's death surfaces when its pieces are used or awaited:
        it becomes a PeerFailure that names the version."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the transfer library's errors have no type of their own
            raise PeerFailure(
                f"actor {self.actor}: version {message.version}'s weights stopped arriving from the trainer "
                f"processes {list(self.plan.processes)} ({str(e).splitlines()[0][:200]}); the sampler keeps "
                "the version it has"
            ) from None

    def pull(self, message: NewWeights) -> tuple[dict, int]:
        """Every piece of `message.version` on the sampler device(s) of its block: ((leaf, device) -> the
        [(slices in the block, piece)], bytes pulled)."""
        plan = self.plan
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        parts: dict = {}  # (leaf, device) -> [(dst_slices, array)]
        copies = []  # (leaf, device, slices, array on another holder of the block)
        nbytes = 0
        got = []  # (offer, the device it lands on, array)
        for p, (reader, wanted) in self.readers.items():  # in place, from the slots on this host
            offers = [plan.offered_by(p)[i] for i in wanted]
            first = [self.holders[o.leaf][o.block][0] for o in offers]
            views = reader.take(message.version, wanted)
            got += zip(offers, first, jax.device_put(views, first), strict=True)
        pulls = [(proc, b, o) for proc in self.conns for b, o in enumerate(self.buckets[proc]) if o]
        for p, b, offered in pulls:
            first = [self.holders[o.leaf][o.block][0] for o in offered]
            specs = [jax.ShapeDtypeStruct(o.shape, plan.dtype, sharding=SingleDeviceSharding(d))
                     for o, d in zip(offered, first, strict=True)]  # fmt: skip
            arrays = self.conns[p].pull(_uuid(message.version, self.actor, b), specs, timeout=deadline)
            got += zip(offered, first, arrays, strict=True)
        for o, d, a in got:
            nbytes += a.nbytes
            parts.setdefault((o.leaf, d), []).append((o.dst_slices, a))
            copies += [(o.leaf, other, o.dst_slices, a) for other in self.holders[o.leaf][o.block][1:]]
        if copies:  # replicas of a block within the replica: device to device
            moved = jax.device_put([a for *_, a in copies], [d for _, d, _, _ in copies])
            for (leaf, d, sl, _), a in zip(copies, moved, strict=True):
                parts.setdefault((leaf, d), []).append((sl, a))
        return parts, nbytes

    def assemble(self, parts: dict) -> list:
        """The leaves in the sampler layout from `pull`'s pieces (each device lays out its own blocks)."""
        blocks: dict = {}
        joins: dict = {}
        for (leaf, dev), got in parts.items():
            if len(got) == 1:
                blocks[(leaf, dev)] = got[0][1]
            else:
                joins.setdefault(dev, []).append(leaf)
        for dev, leaves in joins.items():
            key = (dev, tuple(leaves))
            if key not in self._place:
                plan = []
                for leaf in leaves:
                    shape = self.target[leaf].shard_shape(self.plan.shapes[leaf])
                    plan.append((shape, self.plan.dtype, [sl for sl, _ in parts[(leaf, dev)]]))
                self._place[key] = shard_routes.place_fn(plan)
            placed = self._place[key]([[a for _, a in parts[(leaf, dev)]] for leaf in leaves])
            blocks.update({(leaf, dev): b for leaf, b in zip(leaves, placed, strict=True)})
        return [
            jax.make_array_from_single_device_arrays(
                shape, sh, [blocks[(leaf, d)] for d in sh.addressable_devices_indices_map(shape)]
            )
            for leaf, (shape, sh) in enumerate(zip(self.plan.shapes, self.target, strict=True))
        ]


def sampler_dtype(model_cfg: ModelConfig) -> str:
    """The dtype the sampler holds: the model's compute dtype (bf16 weights from fp32 masters)."""
    return model_cfg.dtype
