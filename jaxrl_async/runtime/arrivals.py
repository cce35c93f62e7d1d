"""The policy versions on their way to one sampler: each starts arriving when its `NewWeights` message
does, lands on the sampler's devices while the sampler decodes on, and is taken, in order, once landed.
"""

from __future__ import annotations

import time

from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import Incoming, checksum


class Arrivals:
    """Versions in transit to a sampler (see the module docstring).

    Args:
      weights: the weight receiver (`LocalWeights` or `TransferReceiver`).
      verify: checksum every received version (a host read of the weights; for tests).
    """

    def __init__(self, weights, verify: bool = False):
        self.weights, self.verify = weights, verify
        self._on_the_way: list[tuple[Incoming, bool]] = []  # (incoming version, whether it is due)
        self.seconds = 0.0  # time spent receiving weights
        self.checksums: dict[int, float] = {}  # version -> checksum (with `verify`)
        self.pulled: dict[int, int] = {}  # version -> bytes it brought (receivers that count them)

    def __bool__(self) -> bool:
        return bool(self._on_the_way)

    def start(self, message: NewWeights, due: bool) -> None:
        """Starts receiving a published version (every one must be taken); `due`: it is to be evaluated."""
        t0 = time.perf_counter()
        self._on_the_way.append((self.weights.start(message), due))
        self.seconds += time.perf_counter() - t0

    def take(self, block: bool, every: bool = False) -> list[tuple[NewWeights, dict, bool]]:
        """(message, params, due) of the versions that have fully landed, oldest first; with `block`
        (nothing else to do) it waits for the oldest one still on its way if none has; with `every`, for
        all of them (the leader of a replica that spans processes: see `Actor`)."""
        t0 = time.perf_counter()
        n = 0
        while n < len(self._on_the_way) and self.weights.ready(self._on_the_way[n][0]):
            n += 1
        if block and not n and self._on_the_way:
            n = 1
        if every:
            n = len(self._on_the_way)
        taken, self._on_the_way = self._on_the_way[:n], self._on_the_way[n:]
        arrived = []
        for incoming, due in taken:
            arrived.append((incoming.message, self.weights.finish(incoming), due))
            if (pulled := getattr(self.weights, "last_bytes", None)) is not None:
                self.pulled[incoming.message.version] = int(pulled)
        self.seconds += time.perf_counter() - t0
        if self.verify:
            # A LoRA receiver (runtime/lora_sync.py) checked the adapters it received, which is what was
            # sent and summed by the trainer; other receivers' versions are summed here.
            checked = getattr(self.weights, "checked", {})
            for m, params, _ in arrived:
                got = checked.pop(m.version, None)
                self.checksums[m.version] = checksum(params) if got is None else got
        return arrived

    def bytes_report(self) -> dict:
        """What the weights brought to this sampler process: per version and, a LoRA run's, its base once
        (the summary's `weight_bytes`)."""
        base = getattr(self.weights, "base_bytes", None)
        return {"versions": dict(self.pulled), **({"base": int(base)} if base is not None else {})}
