"""Controlled lag: the samplers get the weights of version v - k while the trainer is at version v.

With `config.trainer.controlled_lag = k` the learner's publisher is wrapped in `LaggedPublisher`, which
keeps the trainer-layout weights of the last k + 1 versions and offers the oldest of them, stamped with
its own version. In sync mode every token trained at version v >= k was then sampled by version v - k,
exactly k stale, whatever the timing, process layout or admission; with η > 0 staleness is k plus what
admission allows. Versions before the first k train on version 0's samples (staleness 0..k-1), and a
resumed run starts its lag again from the restored version (the copies are not checkpointed). The last
version (`final_version`) is published as it is, so the run's final evaluation is of the trained policy.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp


class LaggedPublisher:
    """Wraps a publisher (`LocalWeights`, `TransferPublisher`): `publish(v, params)` offers version v - k.

    Returns None (nothing to send) when the lagged version is the one offered last, so the samplers
    never receive a version twice.
    """

    def __init__(self, inner, lag: int, final_version: int):
        if lag < 1:
            raise ValueError(f"config.trainer.controlled_lag must be >= 1 here, got {lag}")
        self.inner, self.lag, self.final_version = inner, lag, final_version
        self._kept: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._offered: int | None = None

    @property
    def last_seconds(self) -> float:
        return self.inner.last_seconds

    def publish(self, version: int, params):
        if version >= self.final_version:
            self._kept.clear()
            self._offered = version
            return self.inner.publish(version, params)
        # A copy of its own: the next train step donates the state's buffers.
        self._kept[version] = jax.tree.map(jnp.copy, params)
        target = max(version - self.lag, next(iter(self._kept)))
        while next(iter(self._kept)) < target:
            self._kept.popitem(last=False)
        if target == self._offered:
            return None
        self._offered = target
        return self.inner.publish(target, self._kept[target])


def lagged(publisher, lag: int, final_version: int):
    """`publisher` itself when lag is 0, else a LaggedPublisher around it."""
    return publisher if lag == 0 else LaggedPublisher(publisher, lag, final_version)
