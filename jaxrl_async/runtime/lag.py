"""Controlled lag: the samplers get the weights of version v - k while the trainer is at version v.

With `config.trainer.controlled_lag = k` the learner's publisher is wrapped in `LaggedPublisher`, which
keeps the trainer-layout weights of the last k + 1 versions and offers the oldest of them, stamped with
its own version. In sync mode every token trained at version v >= k was then sampled by version v - k,
exactly k stale, whatever the timing, process layout or admission; with η > 0 staleness is k plus what
admission allows. Versions before the first k train on version 0's samples (staleness 0..k-1), and a
resumed run starts its lag again from the restored version (the copies are not checkpointed).

The end of the run: the samplers never hold versions final - k .. final - 1 for sampling, yet a lag-0
run evaluates the due ones among them, and a study's mean over evaluations must cover the same versions
in every arm (else a lagged arm averages fewer late, better versions and is biased against). So at the
last version (`final_version`) the publisher first offers, oldest first, each kept version newer than the
one offered last that the evaluation schedule (`due`) names, then the final version as it is. Each is an
ordinary publish through the inner publisher: versions stay in order and none is offered twice.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp


class LaggedPublisher:
    """Wraps a publisher (`LocalWeights`, `TransferPublisher`): `publish(v, params)` offers version v - k.

    Returns None (nothing to send) when the lagged version is the one offered last, so the samplers
    never receive a version twice. `publish_all` is what the trainer calls: it also brings the due
    versions of the last k at the end (see the module docstring).

    Args:
      due: version -> whether it is evaluated (EvalSection.due for the run's last version); None: none.
    """

    def __init__(self, inner, lag: int, final_version: int, due: Callable[[int], bool] | None = None):
        if lag < 1:
            raise ValueError(f"config.trainer.controlled_lag must be >= 1 here, got {lag}")
        self.inner, self.lag, self.final_version = inner, lag, final_version
        self.due = due or (lambda v: False)
        self._kept: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._offered: int | None = None

    @property
    def last_seconds(self) -> float:
        return self.inner.last_seconds

    @property
    def last_bytes(self) -> int | None:  # perf/weight_sync_bytes
        return getattr(self.inner, "last_bytes", None)

    def publish_all(self, version: int, params) -> Iterator:
        """The messages for `version`, in order. A generator on purpose: the caller sends each before
        the next is made, because a shared-memory writer (`shm_weights.SlotWriter`) waits for a free slot
        and the readers free one only after they were told of the versions in it: publishing several
        versions before sending any could wait on itself once the slots run out."""
        if version >= self.final_version:
            last = -1 if self._offered is None else self._offered
            for v in [v for v in self._kept if last < v < version and self.due(v)]:
                self._offered = v
                yield self.inner.publish(v, self._kept[v])
        message = self.publish(version, params)
        if message is not None:
            yield message

    def publish(self, version: int, params):
        """One step's offer: version - k's message, or None (see the class docstring); the final version
        as it is (without the catch-up of `publish_all`)."""
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


def lagged(publisher, lag: int, final_version: int, due: Callable[[int], bool] | None = None):
    """`publisher` itself when lag is 0, else a LaggedPublisher around it."""
    return publisher if lag == 0 else LaggedPublisher(publisher, lag, final_version, due)


def publish_all(publisher, version: int, params) -> Iterator:
    """The messages to send for `version`, in order (one, except at a lagged run's end; None entries
    are left out): send each before taking the next."""
    each = getattr(publisher, "publish_all", None)
    messages = each(version, params) if each is not None else iter([publisher.publish(version, params)])
    return (m for m in messages if m is not None)
