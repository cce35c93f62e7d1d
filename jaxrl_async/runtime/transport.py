"""How the roles talk: named endpoints and the messages between them.

Every role owns an endpoint: "coordinator", "learner" (the learner lead), "trainer:<pid>" (the other
trainer processes), "actor:<i>" (sampler replica i), "member:<pid>" (the other processes of a replica that
spans several; its leader's commands reach it on a star of the replica's own, `runtime.replica`). The
roles only `send(endpoint, message)` and `recv(endpoint)`; where an endpoint lives is the transport's
business:

* `LocalTransport` (one process): in-memory queues. Messages are passed as objects, so weights travel
  as device arrays.
* `ZmqTransport` (several processes): a star around the learner lead, which hosts the coordinator and
  the learner. The lead binds a ZeroMQ ROUTER socket on the interface that routes to the coordination
  service (never on every interface), every other process connects a DEALER to it and only ever talks to
  the lead.

On the wire a message is four frames: a header (magic, format version, the run id, the sender's process
id, the sender's frame counter), the body and the array bytes of `jaxrl_async.runtime.codec` (known
message types and plain numpy arrays only: nothing is unpickled), and an HMAC-SHA256 of the other three
under the run's secret (`jaxrl_async.runtime.secret`). The run id is drawn by the hub at start and
published with its address, so frames of another run, even one with the same secret, are refused; a
frame whose counter is not above the last one accepted from its sender is a replay. A frame that fails
any check is dropped and counted (`rejected`, the learner lead's `perf/rejected_messages`), the first
one from each peer address logged; it never raises. The hub addresses a process only after an
authenticated Hello from it, on the connection that Hello came on.

Why ZeroMQ: a maintained message library with framing, per-peer queues and non-blocking polling, which
rollouts (tens of KB to tens of MB per step) and control messages need; the JAX coordination service's
key-value store is built for small configuration values and would turn every queue into polled keys.
Weights do not go through either: `jaxrl_async.runtime.weight_sync` moves them device to device.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import struct

from jaxrl_async.runtime import codec
from jaxrl_async.runtime.cluster import PeerFailure
from jaxrl_async.runtime.messages import Hello

log = logging.getLogger(__name__)

HEADER = struct.Struct(">4sB16sIQ")  # magic, format version, run id, sender process id, frame counter
MAGIC, VERSION = b"JXRL", 1
HUB_LIMITS = codec.Limits()  # what the hub accepts from one frame (a stranger can reach it)
PEER_LIMITS = codec.Limits(max_bytes=1 << 40)  # from the hub: warm-start parameters can be large
BIND_ANY = ("*", "0.0.0.0", "::", "[::]", "")
_MAX_LOGGED_PEERS = 1024


class Rejected(Exception):
    """A frame that fails a check (why in the message)."""


class LocalTransport:
    """Every endpoint in this process: a queue each."""

    rejected = 0  # nothing arrives from outside

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
      address: the host to bind on (lead: an interface's address, never a wildcard), or the hub's
        `address` to connect to ("HOST:PORT#RUN_ID", as the hub publishes it).
      process_id: this process's id (every frame names its sender).
      secret: the run's secret (`jaxrl_async.runtime.secret.load`).
      hub_limits: what the hub accepts in one message (`HUB_LIMITS`; the same on every process).
    """

    def __init__(self, local: list[str], lead: bool, address: str, process_id: int, secret: bytes,
                 hub_limits: codec.Limits = HUB_LIMITS):  # fmt: skip
        import zmq

        if len(secret) < 16:
            raise ValueError("ZmqTransport: the secret is too short (see jaxrl_async.runtime.secret)")
        self._zmq = zmq
        self.local = set(local)
        self.lead, self.process_id, self._secret = lead, process_id, secret
        self._ctx = zmq.Context.instance()
        self._queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._routes: dict[str, int] = {}  # endpoint -> process id (hub only)
        self._peers: dict[int, bytes] = {}  # process id -> ZeroMQ routing id of its authenticated Hello
        self._outbox: dict[int, list] = collections.defaultdict(list)  # frames for a process not yet seen
        self._last: dict[int, int] = {}  # sender -> its last accepted frame counter
        self._sent = 0
        self.rejected = 0
        self.rejected_reasons: collections.Counter = collections.Counter()
        self._logged: set[str] = set()
        if lead:
            if address.strip("[]") in BIND_ANY:
                raise ValueError(f"ZmqTransport: the hub binds one interface's address, not {address!r}")
            self.run_id = secrets.token_bytes(16)
            self._limits, self._peer_limits = hub_limits, PEER_LIMITS
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of dropping
            self._sock.setsockopt(zmq.MAXMSGSIZE, hub_limits.max_bytes)  # a larger frame drops its connection
            self._sock.bind(f"tcp://{address}:0")
            where = self._sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
            self.address = f"{where}#{self.run_id.hex()}"
            log.info("message hub on %s (run id %s)", where, self.run_id.hex())  # the run id is no secret
        else:
            where, _, run_id = address.partition("#")
            self.run_id = bytes.fromhex(run_id)
            if len(self.run_id) != 16:
                raise ValueError(f"ZmqTransport: {address!r} is not a hub address (HOST:PORT#RUN_ID)")
            self._limits, self._peer_limits = PEER_LIMITS, hub_limits
            self._sock = self._ctx.socket(zmq.DEALER)
            # Unguessable, and kept across reconnects: no stranger can take this process's place at the hub.
            self._sock.setsockopt(zmq.IDENTITY, f"p{process_id}-{secrets.token_hex(8)}".encode())
            self._sock.connect(f"tcp://{where}")
            self.address = address
        self._sock.setsockopt(zmq.LINGER, 2000)

    def route(self, endpoint: str, process_id: int) -> None:
        """Hub: messages for `endpoint` go to process `process_id` (once it has said Hello)."""
        self._routes[endpoint] = process_id

    # ----- sending -----

    def seal(self, endpoint: str, message) -> list:
        """The four frames of `message` (see the module docstring; public for tests and benchmarks)."""
        body, buffers = codec.encode(endpoint, message)
        if len(body) + len(buffers) > self._peer_limits.max_bytes:
            raise codec.CodecError(
                f"a {type(message).__name__} of {len(body) + len(buffers)} bytes is over the receiver's "
                f"limit of {self._peer_limits.max_bytes}"
            )
        self._sent += 1
        header = HEADER.pack(MAGIC, VERSION, self.run_id, self.process_id, self._sent)
        return [header, body, buffers, self._mac(header, body, buffers)]

    def _mac(self, header, body, buffers) -> bytes:
        h = hmac.new(self._secret, header, hashlib.sha256)
        h.update(struct.pack(">QQ", len(body), len(buffers)))  # the frames' boundaries are signed too
        h.update(body)
        h.update(buffers)
        return h.digest()

    def send(self, endpoint: str, message) -> None:
        if endpoint in self.local:
            self._queues[endpoint].append(message)
            return
        if not self.lead:
            self._sock.send_multipart(self.seal(endpoint, message), copy=False)
            return
        if endpoint not in self._routes:
            raise KeyError(f"no process hosts endpoint {endpoint!r}")
        pid = self._routes[endpoint]
        frames = self.seal(endpoint, message)
        if pid not in self._peers:  # not connected yet: sent once its Hello arrives
            self._outbox[pid].append((endpoint, frames))
            return
        self._send_to(pid, endpoint, frames)

    def _send_to(self, pid: int, endpoint: str, frames: list) -> None:
        try:
            self._sock.send_multipart([self._peers[pid], *frames], copy=False)
        except self._zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer's connection is gone
            raise PeerFailure(f"process {pid} ({endpoint}) is unreachable: it has stopped ({e})") from None

    # ----- receiving -----

    def open(self, parts: list, routing_id: bytes | None = None) -> tuple[int, str, object]:
        """(sender, endpoint, message) of the received `parts` (zmq.Frame) if they are an authentic, fresh,
        well-formed message (at the hub: on the connection of its sender's Hello, `routing_id`); else
        raises Rejected. A rejected frame leaves the sender's counter as it was."""
        if len(parts) != 4:
            raise Rejected(f"malformed: {len(parts)} frames, expected 4")
        header, body, buffers, mac = (p.buffer for p in parts)
        if len(header) != HEADER.size:
            raise Rejected("malformed header")
        magic, version, run_id, sender, counter = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise Rejected("not a jaxrl_async frame (or another format version)")
        if run_id != self.run_id:
            raise Rejected("from another run")
        if len(body) + len(buffers) > self._limits.max_bytes:
            raise Rejected(f"oversized: {len(body) + len(buffers)} bytes > {self._limits.max_bytes}")
        if not hmac.compare_digest(self._mac(header, body, buffers), bytes(mac)):
            raise Rejected("bad MAC (not signed with this run's secret)")
        if self.lead and sender not in self._routes.values():
            raise Rejected(f"from process {sender}, which is not in the run")
        if counter <= self._last.get(sender, 0):
            raise Rejected(f"replayed (frame {counter} of process {sender} was accepted already)")
        try:
            endpoint, message = codec.decode(bytes(body), buffers, self._limits)
        except codec.CodecError as e:
            raise Rejected(f"undecodable: {e}") from None
        if isinstance(message, Hello) and message.process_id != sender:
            raise Rejected(f"a Hello of process {message.process_id} sent by process {sender}")
        if self.lead:
            hello = isinstance(message, Hello) and sender not in self._peers
            if not hello and self._peers.get(sender) != routing_id:
                raise Rejected(f"from process {sender} on a connection other than its Hello's")
        self._last[sender] = counter
        return sender, endpoint, message

    def _reject(self, frame, why: str) -> None:
        self.rejected += 1
        self.rejected_reasons[why.split(":")[0].split(" (")[0]] += 1
        try:
            peer = frame.get("Peer-Address")
        except Exception:  # noqa: BLE001 - the property is missing on some transports
            peer = "an unknown address"
        if peer not in self._logged and len(self._logged) < _MAX_LOGGED_PEERS:
            self._logged.add(peer)
            log.warning(
                "dropped a message from %s: %s (further ones from there are only counted: "
                "perf/rejected_messages)", peer, why,
            )  # fmt: skip

    def _drain(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                routing_id = frames[0].bytes if self.lead else None
                sender, endpoint, message = self.open(frames[1:] if self.lead else frames, routing_id)
                if self.lead:
                    self._take(routing_id, sender, endpoint, message)
                else:
                    self._queues[endpoint].append(message)
            except Rejected as e:
                self._reject(frames[-1], str(e))

    def _take(self, routing_id: bytes, sender: int, endpoint: str, message) -> None:
        """Hub: an authenticated message from process `sender`, which came on `routing_id`."""
        if sender not in self._peers:  # its Hello (`open` checked)
            self._peers[sender] = routing_id
            for ep, frames in self._outbox.pop(sender, []):
                self._send_to(sender, ep, frames)
        if endpoint in self.local:
            self._queues[endpoint].append(message)
        elif endpoint in self._routes:  # forward between other processes
            self.send(endpoint, message)
        else:
            raise Rejected(f"for endpoint {endpoint!r}, which no process hosts")

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
