"""Adapter-only weight sync for LoRA runs (config.trainer.lora), in one process.

The base is frozen, so it moves to the sampler once, when the run starts (`LoraWeights.__init__`); each
version then moves only the adapters: rank r on every projection of an 8B model is tens of MB against the
16 GB of bf16 a full version moves. The receiver checks what it got against the publisher's checksum of
the adapters it sent (`config.verify_weights`), then hands the sampler a whole model tree:

* lora_apply="merge": W + (alpha/r)·A·B written into a copy of its base (one float32 sum per weight).
* lora_apply="unmerged": the base with the adapters beside it (`model.lora.combine`), which an engine built
  with the LoRA (`Engine(lora=...)`) decodes as x·W + (x·A)·B. The base leaves are the same arrays every
  version, so the engine lays out only the adapters (`Engine.update_params`).

Same interface as `weight_sync.LocalWeights`, so the learner and the actor are unchanged. Across
processes (`TransferPublisher`) LoRA is not wired yet: the run refuses it (runtime/build.py).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxrl_async.model import ModelConfig
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import Incoming, WeightSync, checksum, sampler_dtype


class WeightsMismatch(RuntimeError):
    """The adapters a sampler received do not sum to the checksum the trainer sent with them."""


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class LoraWeights:
    """Publisher and receiver of one process (see the module docstring).

    Attributes:
      base_bytes: bytes the base moved, once.
      last_bytes: bytes the last published version moved (the adapters): perf/weight_sync_bytes.
      verified: versions whose received adapters matched the publisher's checksum.
    """

    def __init__(self, model_cfg: ModelConfig, lora, sampler_mesh, base, verify: bool = False,
                 apply: str = "unmerged"):  # fmt: skip
        self.lora, self.verify, self.apply = lora, verify, apply
        dtype = sampler_dtype(model_cfg)
        self.base = WeightSync(model_cfg, sampler_mesh, dtype=dtype)(base, wait=True)
        self.base_bytes = tree_bytes(self.base)
        specs = lora_lib.adapter_specs(model_cfg, lora)
        self.sync = WeightSync(model_cfg, sampler_mesh, dtype=dtype, specs=specs)
        shardings = jax.tree.map(lambda x: x.sharding, self.base)
        self._merge = jax.jit(functools.partial(lora_lib.merge, lora=lora), out_shardings=shardings)
        self.last_bytes = 0
        self.verified: list[int] = []

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
        adapters = message.params
        if message.checksum is not None:
            got = checksum(adapters)
            if not np.isclose(got, message.checksum, rtol=1e-5, atol=1e-6):
                raise WeightsMismatch(
                    f"version {message.version}: received adapters sum to {got}, sent {message.checksum}"
                )
            self.verified.append(message.version)
        if self.apply == "merge":
            return self._merge(self.base, adapters)
        return lora_lib.combine(self.base, adapters, self.lora)
