"""How the roles talk: named endpoints and the messages between them.

Every role owns an endpoint: "coordinator", "learner" (the learner lead), "trainer:<pid>" (the other
trainer processes), "actor:<i>" (sampler replica i). The roles only `send(endpoint, message)` and
`recv(endpoint)`; where an endpoint lives is the transport's business:

* `LocalTransport` (one process): in-memory queues. Messages are passed as objects, so weights travel
  as device arrays.
* `ZmqTransport` (several processes): a star around the learner lead, which hosts the coordinator and
  the learner. The lead binds a ZeroMQ ROUTER socket, every other process connects a DEALER to it and
  only ever talks to the lead. Messages are pickled (numpy arrays travel as protocol-5 buffers).

Why ZeroMQ: a maintained message library with framing, per-peer queues and non-blocking polling, which
rollouts (tens of KB to tens of MB per step) and control messages need; the JAX coordination service's
key-value store is built for small configuration values and would turn every queue into polled keys.
Weights do not go through either: `jaxrl_async.runtime.weight_sync` moves them device to device.
"""

from __future__ import annotations

import collections
import pickle

from jaxrl_async.runtime.cluster import PeerFailure
from jaxrl_async.runtime.messages import Hello, NewWeights  # noqa: F401 - NewWeights: importers of its old place

# ----- transports ----------------------------------------------------------------------------------------


class LocalTransport:
    """Every endpoint in this process: a queue each."""

    def __init__(self):
        self._queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def send(self, endpoint: str, message) -> None:
        self._queues[endpoint].append(message)

    def recv(self, endpoint: str) -> list:
        """Every message waiting for `endpoint` (never blocks)."""
        q = self._queues[endpoint]
        out = list(q)
        q.clear()
        return out

    def wait(self, timeout_s: float) -> None:
        """Nothing arrives from outside a single process: returns at once."""

    def close(self) -> None:
        pass


class ZmqTransport:
    """The star of a multi-process run; this process hosts `local` endpoints.

    Args:
      local: the endpoints hosted here.
      lead: whether this is the hub (the learner lead).
      address: the hub's address to connect to (non-lead), or the host to bind on (lead).
    """

    def __init__(self, local: list[str], lead: bool, address: str, process_id: int):
        import zmq

        self._zmq = zmq
        self.local = set(local)
        self.lead = lead
        self._ctx = zmq.Context.instance()
        self._queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._routes: dict[str, bytes] = {}  # endpoint -> peer identity (hub only)
        if lead:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of dropping
            self._sock.bind(f"tcp://{address}:0")
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
        else:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, str(process_id).encode())
            self._sock.connect(f"tcp://{address}")
            self.address = address
        self._sock.setsockopt(zmq.LINGER, 2000)

    def route(self, endpoint: str, process_id: int) -> None:
        """Hub: messages for `endpoint` go to process `process_id`."""
        self._routes[endpoint] = str(process_id).encode()

    def send(self, endpoint: str, message) -> None:
        if endpoint in self.local:
            self._queues[endpoint].append(message)
            return
        payload = pickle.dumps((endpoint, message), protocol=5)
        if self.lead:
            if endpoint not in self._routes:
                raise KeyError(f"no process hosts endpoint {endpoint!r}")
            try:
                self._sock.send_multipart([self._routes[endpoint], payload])
            except self._zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer's connection is gone
                pid = self._routes[endpoint].decode()
                raise PeerFailure(
                    f"process {pid} ({endpoint}) is unreachable: it has stopped ({e})"
                ) from None
        else:
            self._sock.send(payload)

    def _drain(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            endpoint, message = pickle.loads(frames[-1])
            if self.lead and endpoint not in self.local:  # hub: forward between other processes
                self.send(endpoint, message)
            else:
                self._queues[endpoint].append(message)

    def recv(self, endpoint: str) -> list:
        self._drain()
        q = self._queues[endpoint]
        out = list(q)
        q.clear()
        return out

    def wait(self, timeout_s: float) -> None:
        """Blocks until a message arrives or `timeout_s` passes."""
        if not any(self._queues.values()):
            self._sock.poll(int(timeout_s * 1000))

    def close(self) -> None:
        self._sock.close()

