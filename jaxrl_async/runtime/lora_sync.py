"""Adapter-only weight sync for LoRA runs (config.trainer.lora).

The base is frozen, so it moves to the sampler once, when the run starts; each version then moves only the
adapters: rank r on every projection of an 8B model is tens of MB against the 16 GB of bf16 a full version
moves. The receiver checks what it got against the publisher's checksum of the adapters it sent
(`config.verify_weights`; the base's too, once, across processes), then hands the sampler a whole tree:

* lora_apply="merge": W + (alpha/r)·A·B written into a copy of its base (one float32 sum per weight).
* lora_apply="unmerged": the base with the adapters beside it (`model.lora.combine`), which an engine built
  with the LoRA (`Engine(lora=...)`) decodes as x·W + (x·A)·B. The base leaves are the same arrays every
  version, so the engine lays out only the adapters (`Engine.update_params`).

One process: `LoraWeights` (the interface of `weight_sync.LocalWeights`). Several processes:
`LoraPublisher` on every trainer process and `LoraReceiver` on every sampler process (the interfaces of
`TransferPublisher` / `TransferReceiver`), over two channels of the same machinery (`weight_sync.Channel`):
the base, offered once with the first version, and the adapters, every version; each goes through shared
memory between processes of one CPU host, else the transfer server. The learner and actor are unchanged.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from jaxrl_async.model import ModelConfig
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import (
    Channel,
    Incoming,
    TransferPublisher,
    TransferReceiver,
    WeightSync,
    checksum,
    sampler_dtype,
)

BASE = Channel("lora_base:", slots=1)  # the frozen base: offered once, so one shared-memory slot
BASE_CHECKSUM_KEY = "lora_base:checksum"  # the base's checksum (config.verify_weights), in the cluster store
BASE_TAKEN = "lora_base:taken/"  # + the pull: that receiver holds the base (the offer may be released)


class WeightsMismatch(RuntimeError):
    """The adapters a sampler received do not sum to the checksum the trainer sent with them."""


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def adapters_channel(model_cfg: ModelConfig, lora) -> Channel:
    return Channel("lora:", lora_lib.adapter_specs(model_cfg, lora))


def _same(got: float, sent: float) -> bool:
    return bool(np.isclose(got, sent, rtol=1e-5, atol=1e-6))


class _Apply:
    """The receiving end shared by both paths: a version's adapters, checked, onto the base once received.

    Attributes:
      checked: version -> the checksum of the adapters received, for the versions whose message carried
        one (config.verify_weights) and matched it; `Arrivals` reports these as the sampler's checksums.
    """

    def __init__(self, lora, apply: str):
        self.lora, self.apply = lora, apply
        self.base = None
        self._merge = None
        self.checked: dict[int, float] = {}

    def set_base(self, base) -> None:
        self.base = base
        shardings = jax.tree.map(lambda x: x.sharding, base)
        self._merge = jax.jit(functools.partial(lora_lib.merge, lora=self.lora), out_shardings=shardings)

    def __call__(self, message: NewWeights, adapters):
        """The sampler's whole tree for this version (merged, or base + adapters), after the check."""
        if message.checksum is not None:
            got = checksum(adapters)
            if not _same(got, message.checksum):
                raise WeightsMismatch(
                    f"version {message.version}: received adapters sum to {got}, sent {message.checksum}"
                )
            self.checked[message.version] = got
        if self.apply == "merge":
            return self._merge(self.base, adapters)
        return lora_lib.combine(self.base, adapters, self.lora)


class LoraWeights:
    """Publisher and receiver of one process (see the module docstring).

    Attributes:
      base_bytes: bytes the base moved, once.
      last_bytes: bytes the last published version moved (the adapters): perf/weight_sync_bytes.
      checked: version -> the checksum of its received adapters, where checked (`_Apply`).
    """

    def __init__(self, model_cfg: ModelConfig, lora, sampler_mesh, base, verify: bool = False,
                 apply: str = "unmerged"):  # fmt: skip
        self.lora, self.verify = lora, verify
        dtype = sampler_dtype(model_cfg)
        self.base = WeightSync(model_cfg, sampler_mesh, dtype=dtype)(base, wait=True)
        self.base_bytes = tree_bytes(self.base)
        specs = lora_lib.adapter_specs(model_cfg, lora)
        self.sync = WeightSync(model_cfg, sampler_mesh, dtype=dtype, specs=specs)
        self._apply = _Apply(lora, apply)
        self._apply.set_base(self.base)
        self.checked = self._apply.checked
        self.last_bytes = 0

    @property
    def last_seconds(self) -> float:
        return self.sync.last_seconds

    def publish(self, version: int, adapters) -> NewWeights:
        out = self.sync(adapters, wait=False)
        self.last_bytes = tree_bytes(out)
        return NewWeights(version, out, checksum(out) if self.verify else None)

    def start(self, message: NewWeights) -> Incoming:
        return Incoming(message, None, tree_bytes(message.params))

    def ready(self, incoming: Incoming) -> bool:
        return True

    def finish(self, incoming: Incoming):
        return self.receive(incoming.message)

    def receive(self, message: NewWeights):
        """The sampler's whole tree for this version (merged, or base + adapters), after the check."""
        return self._apply(message, message.params)


class LoraPublisher:
    """Trainer side across processes (every trainer process, every version, in step order, like
    `TransferPublisher`): the first `publish` offers the frozen base once, then every publish offers only
    the adapters. `targets`: `TransferPublisher`'s (the members of replicas that span processes).

    Attributes:
      base_bytes: what the base moved to each sampler replica, once.
      last_bytes: what the last version moved to each sampler replica (the adapters): perf/weight_sync_bytes.
    """

    def __init__(self, cluster, model_cfg: ModelConfig, lora, trainer_mesh, sampler_shape, num_actors: int,
                 base, verify: bool = False, transport: str = "auto",
                 targets: dict | None = None):  # fmt: skip
        dtype = sampler_dtype(model_cfg)
        args = (cluster, model_cfg, trainer_mesh, sampler_shape, dtype, num_actors, verify)
        self.cluster, self._base, self.num_actors = cluster, base, num_actors
        self.base_offered = False  # the base's pieces are held for pulls still to come
        # targets: the members of spanning replicas, each offered only its devices' pieces of either tree
        self.base = TransferPublisher(*args, targets=targets, transport=transport, channel=BASE)
        channel = adapters_channel(model_cfg, lora)
        self.adapters = TransferPublisher(*args, targets=targets, transport=transport, channel=channel)
        self.base_bytes, self.last_seconds = 0, 0.0

    @property
    def last_bytes(self) -> int:
        return self.adapters.last_bytes

    def resolve_paths(self) -> None:
        """See `TransferPublisher.resolve_paths`: before the trainer processes' first collective."""
        self.base.resolve_paths()
        self.adapters.resolve_paths()

    def publish(self, version: int, adapters) -> NewWeights:
        t0 = time.perf_counter()
        if self._base is not None:  # the run's first version: the base goes first, once
            sent = self.base.publish(0, self._base)
            if sent.checksum is not None and self.cluster.is_lead:
                self.cluster.publish(BASE_CHECKSUM_KEY, repr(sent.checksum))
            self.base_bytes, self._base, self.base_offered = self.base.last_bytes, None, True
        elif self.base_offered and self.cluster.published_under(BASE_TAKEN) == self.num_actors:
            # Over the transfer server the cut pieces of the base (a sampler-dtype copy of this process's
            # shards) would otherwise stay on the trainer's devices for the whole run.
            self.base.release(0)
            self.base_offered = False
        message = self.adapters.publish(version, adapters)
        self.last_seconds = time.perf_counter() - t0
        return message

    def close(self) -> None:
        self.base.close()
        self.adapters.close()


class LoraReceiver:
    """Sampler side across processes: the base once (with the first version, checked against the
    publisher's checksum with config.verify_weights), then each version's adapters, checked and applied
    (`_Apply`). A member of a replica that spans processes has its own, pulling its devices' pieces of
    each and checking them (the leader passes the sent checksum on, `MemberReceive.checksum`).

    Attributes:
      base_bytes: what the base brought, once; last_bytes: what the last version brought (the adapters).
      checked: see `_Apply`.
    """

    def __init__(self, cluster, actor: int, model_cfg: ModelConfig, lora, trainer_mesh, sampler_mesh,
                 verify: bool = False, apply: str = "unmerged", transport: str = "auto"):  # fmt: skip
        args = (cluster, actor, model_cfg, trainer_mesh, sampler_mesh, sampler_dtype(model_cfg))
        self.cluster, self.verify = cluster, verify
        self.base = TransferReceiver(*args, transport=transport, channel=BASE)
        channel = adapters_channel(model_cfg, lora)
        self.adapters = TransferReceiver(*args, transport=transport, channel=channel)
        self._apply = _Apply(lora, apply)
        self.checked = self._apply.checked
        self.base_bytes = 0

    @property
    def last_bytes(self) -> int:
        return self.adapters.last_bytes

    @property
    def last_seconds(self) -> float:
        return self.adapters.last_seconds

    def _take_base(self) -> None:
        base = self.base.receive(NewWeights(0))
        if self.verify:
            got, sent = checksum(base), float(self.cluster.lookup(BASE_CHECKSUM_KEY, self.base.timeout_s))
            if not _same(got, sent):
                raise WeightsMismatch(f"the LoRA base: received weights sum to {got}, sent {sent}")
        self._apply.set_base(base)
        self.base_bytes = self.base.last_bytes
        self.cluster.publish(BASE_TAKEN + str(self.base.actor), "1")

    def start(self, message: NewWeights) -> Incoming:
        if self._apply.base is None:
            self._take_base()
        return self.adapters.start(message)

    def ready(self, incoming: Incoming) -> bool:
        return self.adapters.ready(incoming)

    def finish(self, incoming: Incoming):
        return self._apply(incoming.message, self.adapters.finish(incoming))

    def receive(self, message: NewWeights):
        return self.finish(self.start(message))
