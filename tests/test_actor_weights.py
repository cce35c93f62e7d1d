"""The actor decodes on with the version it has while a new one is in transit, and swaps it in between two
decode calls once every piece has landed."""

from test_orchestrator import _small

from jaxrl_async.runtime.build import build_local
from jaxrl_async.runtime.messages import NewWeights


class _InTransit:
    """A weight receiver whose versions after the first stay in transit until `land` is called (the
    pull of a large model over a slow wire)."""

    def __init__(self, inner):
        self.inner, self.landed = inner, False

    def start(self, message):
        return self.inner.start(message)

    def ready(self, incoming):
        return incoming.message.version == 0 or self.landed

    def finish(self, incoming):
        return self.inner.finish(incoming)


def test_the_actor_decodes_on_while_a_version_is_in_transit(tmp_path):
    proc = build_local(_small(tmp_path, eval_every=0, **{"mesh.sampler": (1, 1), "mesh.trainer": (1, 1)}))
    actor, coordinator, transport = proc.actor, proc.coordinator, proc.actor.transport
    actor.arrivals.weights = _InTransit(actor.arrivals.weights)

    def rounds(n):
        for _ in range(n):
            actor.poll()
            coordinator.poll()
            for m in transport.recv("learner"):
                assert not isinstance(m, NewWeights)

    try:
        rounds(3)  # version 0 (the learner published it when built) is in; the sampler starts decoding
        assert actor.version == 0 and not actor.loop.idle
        v0 = proc.learner.core.publish()
        transport.send("actor:0", NewWeights(1, v0.params))
        before = actor.loop.stats.decode_steps
        rounds(3)
        # Version 1 is on its way: the sampler kept decoding with version 0 and has not swapped.
        assert actor.version == 0 and actor.loop.stats.decode_steps > before and not actor.loop.idle
        actor.arrivals.weights.landed = True
        rounds(1)
        assert actor.version == 1 and actor.loop.engine.version == 1  # swapped in between two calls
    finally:
        proc.close()
