"""The control plane between processes: a stranger's bytes never run code, never crash the hub, and are
counted; every message type survives the codec; a multi-process run without a secret does not start."""

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from jaxrl_async.data.prompt import Prompt
from jaxrl_async.rollouts import Rollout
from jaxrl_async.runtime import codec, secret
from jaxrl_async.runtime import messages as m
from jaxrl_async.runtime.transport import ZmqTransport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"s" * 64


def _rollout(g: int, i: int) -> Rollout:
    rng = np.random.default_rng(g * 8 + i)
    return Rollout(
        uid=f"0:{g}", group_id=g, sample_index=i, prompt_tokens=rng.integers(0, 9, 5, dtype=np.int32),
        completion_tokens=rng.integers(0, 9, 7, dtype=np.int32),
        behav_logprobs=rng.standard_normal(7).astype(np.float32), versions=np.arange(7, dtype=np.int32),
        reward=0.5, finish_reason="stop", metadata={"text": "7 é", "prompt": "1+6", "overlong_penalty": 0.0},
    )  # fmt: skip


def _final(reward_stats: dict) -> m.ActorStats:
    return dataclasses.replace(m.ActorStats.empty(), reward_stats=reward_stats)


PROMPT = Prompt("a:1", "1+1=", np.array([3, 4], np.int32), "2", {"answer": "2", "task": "arithmetic"}, "0:1")
EXAMPLES = {
    m.Hello: m.Hello(3),
    m.TicketRequest: m.TicketRequest(1, 4),
    m.Tickets: m.Tickets([(7, PROMPT), (8, PROMPT)], exhausted=True),
    m.Rollouts: m.Rollouts(0, [[_rollout(1, 0), _rollout(1, 1)]], m.ActorStats(
        version=3, sample_tokens=70, completions=10, occupancy=0.5, idle_s=1.5, weight_s=0.25, eval_s=2.0,
        eval_spans=[(0, 1.0, 2.5)], evals_skipped=[2], sample_calls_during_eval=4, reward_errors=1,
        drained=False, checksums={2: 0.25})),
    m.NewWeights: m.NewWeights(5, None, 1.25),
    m.EvalResult: m.EvalResult(4, 0.75, 2.0),
    m.TrainBatch: m.TrainBatch(2, [[_rollout(3, 0)]]),
    m.Trained: m.Trained(2, [1, 2], [3], [4]),
    m.SaveCheckpoint: m.SaveCheckpoint(3, {"data": {"epoch": 0, "pos": [1, 2]}, "in_flight": [[1, "0:1"]]},
                                       {"eval_accuracy": 0.5}, wait=True),
    m.Stop: m.Stop(),
    m.Preempt: m.Preempt(1, "SIGTERM"),
    m.Stopped: m.Stopped(0, _final({"errors": {"timeout": 2}})),
    m.WarmStartParams: m.WarmStartParams({"embed": np.ones((2, 3), np.float32),
                                          "layers": {"w": np.zeros((2, 2), np.float16)}}),
    m.MemberRequest: m.MemberRequest(7, np.array([3, 4, 5], np.int32), 4, 7_000_021, None),
    m.MemberStep: m.MemberStep(3, [m.MemberRequest(8, np.array([1], np.int32), 2, 9, 16)], evaluate=True),
    m.MemberResume: m.MemberResume(True, 3, 1, np.array([5, 6], np.int32), 12),
    m.MemberFinish: m.MemberFinish(False, 3, 1),
    m.MemberEvalRequest: m.MemberEvalRequest(m.MemberRequest(0, np.array([1, 2], np.int32), 1, 0, 8, True)),
    m.MemberEvalStep: m.MemberEvalStep(),
    m.MemberReceive: m.MemberReceive(2, hold=True),
    m.MemberApply: m.MemberApply(2, "recompute_kv"),
    m.MemberEvaluate: m.MemberEvaluate(2, own_weights=False),
    m.MemberPing: m.MemberPing(),
    m.MemberReport: m.MemberReport(2, 40, 1200, {1: 0, 2: 36}, {1: 0.5}, 4096),
}  # fmt: skip


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_every_message_type_survives_the_codec():
    assert set(EXAMPLES) == set(codec.MESSAGE_TYPES)  # a new message type needs an example here
    for t, msg in EXAMPLES.items():
        endpoint, got = codec.decode(*codec.encode("learner", msg))
        assert endpoint == "learner" and _same(msg, got), t.__name__
    _, got = codec.decode(*codec.encode("x", EXAMPLES[m.Rollouts]))
    got.groups[0][0].completion_tokens[0] = 1  # decoded arrays are writable (the learner pads them)


def _body(tree) -> bytes:
    import json

    return json.dumps(["learner", tree]).encode()


def _in_dict(d: list) -> list:
    """A message whose field is plain data (a SaveCheckpoint's coordinator state) holding `d`."""
    return ["o", "SaveCheckpoint", 1, d, None, False]


@pytest.mark.parametrize(
    "tree,buffers,why",
    [
        (["o", "Popen", "ls"], b"", "not a message type"),
        (["o", "Hello", "1"], b"", "expected int"),
        (["o", "Hello", 2**70], b"", "int64"),
        (["o", "Hello"], b"", "fields"),
        (["o", "NewWeights", 1, ["d", "w", 1], None], b"", "None"),
        (_in_dict(["d", "x", ["o", "Stop"]]), b"", "plain data"),
        (_in_dict(["d", "x", ["a", "object", [1]]]), b"\0" * 8, "dtype"),
        (_in_dict(["d", "x", ["a", "float32", [4]]]), b"\0" * 8, "missing"),
        (_in_dict(["d", "x", ["a", "float32", [-1]]]), b"", "shape"),
        (_in_dict(["d", "x", ["a", "int8", [1]]]), b"\0" * 64, "belong to no array"),
        (_in_dict(["d", "x", ["l"] * 1 + [["l"]] * 3]), b"", None),  # fine: plain lists
        (_in_dict(["d", "x", "y", "z"]), b"", "odd"),
        (_in_dict(["d", 1.5, 2]), b"", "key"),
        (["o", "MemberStep", 0, ["l", ["o", "Hello", 1]], False], b"", "expected a MemberRequest"),
        (["o", "MemberStep", 0, ["l"], 1], b"", "expected bool"),
        (["o", "MemberApply", 1, 2], b"", "expected str"),
    ],
)
def test_the_decoder_refuses_what_is_not_a_known_message(tree, buffers, why):
    if why is None:
        codec.decode(_body(tree), buffers)
        return
    with pytest.raises(codec.CodecError, match=why):
        codec.decode(_body(tree), buffers)


def test_the_decoder_bounds_depth_size_and_garbage():
    inner = 0
    for _ in range(100):
        inner = ["l", inner]
    deep = ["o", "SaveCheckpoint", 1, ["d", "x", inner], None, False]
    with pytest.raises(codec.CodecError, match="deeper"):
        codec.decode(_body(deep), b"")
    with pytest.raises(codec.CodecError, match="malformed"):
        codec.decode(b"[" * 100_000, b"")  # deeper than the JSON parser goes
    with pytest.raises(codec.CodecError, match="oversized"):
        codec.decode(_body(["o", "Stop"]), b"\0" * 100, codec.Limits(max_bytes=64))
    with pytest.raises(codec.CodecError, match="malformed"):
        codec.decode(os.urandom(256), b"")
    with pytest.raises(codec.CodecError, match="values"):
        codec.decode(
            _body(["o", "Trained", 1, ["l", *range(50)], ["l"], ["l"]]), b"", codec.Limits(max_values=20)
        )
    with pytest.raises(codec.CodecError, match="cannot cross"):
        codec.encode("learner", m.SaveCheckpoint(1, {"f": open}))
    # An actor's counters cross only inside a Rollouts or Stopped, each field of its own type.
    with pytest.raises(codec.CodecError, match="not a message"):
        codec.encode("learner", m.ActorStats.empty())
    stats = codec.encode("learner", m.Stopped(0, m.ActorStats.empty()))[0].replace(b"false", b'"no"')
    with pytest.raises(codec.CodecError, match="ActorStats.drained"):
        codec.decode(stats, b"")


# ----- a real hub and strangers -----------------------------------------------------------------------


def _recv(t: ZmqTransport, endpoint: str, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = t.recv(endpoint)
        if got:
            return got
        t.wait(0.05)
    raise AssertionError(f"nothing arrived at {endpoint}")


def _settle(t: ZmqTransport, want: int, timeout_s: float = 10.0) -> None:
    """Drains the hub until `want` frames were rejected."""
    deadline = time.monotonic() + timeout_s
    while t.rejected < want and time.monotonic() < deadline:
        t.recv("learner")
        t.wait(0.05)


class _Touch:
    """Unpickling this creates a file (what an attacker's pickle would do, harmlessly)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def hub_and_peer():
    hub = ZmqTransport(["learner", "hello"], True, "127.0.0.1", 0, SECRET, codec.Limits(max_bytes=1 << 20))
    hub.route("actor:0", 1)
    peer = ZmqTransport(["actor:0"], False, hub.address, 1, SECRET, codec.Limits(max_bytes=1 << 20))
    peer.send("hello", m.Hello(1))
    assert _recv(hub, "hello") == [m.Hello(1)]
    yield hub, peer
    peer.close()
    hub.close()


def test_hostile_frames_are_dropped_counted_and_logged_once(hub_and_peer, tmp_path, caplog):
    hub, peer = hub_and_peer
    where = hub.address.partition("#")[0]
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(f"tcp://{where}")
    marker = str(tmp_path / "pwned")
    evil = pickle.dumps(("learner", _Touch(marker)))
    real = peer.seal("learner", m.TicketRequest(0, 2))  # a genuine frame, sent once by its peer
    peer._sock.send_multipart(real)
    assert _recv(hub, "learner") == [m.TicketRequest(0, 2)]
    other_run = ZmqTransport(["actor:0"], False, f"{where}#{'ab' * 16}", 1, SECRET)
    other_secret = ZmqTransport(["actor:0"], False, hub.address, 1, b"t" * 64)
    wrong_mac = peer.seal("learner", m.TicketRequest(0, 99))
    wrong_mac[3] = bytes(32)
    tampered = peer.seal("learner", m.TicketRequest(0, 1))
    tampered[1] = tampered[1].replace(b"1]", b"9]")
    hostile = [
        [evil],  # what the old hub unpickled
        [b"", b"", b"", evil],
        [os.urandom(256)],
        [os.urandom(33), os.urandom(64), b"", os.urandom(32)],
        [real[0], b"x" * 600_000, b"y" * 600_000, real[3]],  # oversized: over the hub's 1 MiB in total
        real,  # a replay of a real message, from another connection
        other_run.seal("learner", m.TicketRequest(0, 3)),  # another run's frame, same secret
        other_secret.seal("learner", m.TicketRequest(0, 4)),  # signed with another run's secret
        wrong_mac,
        tampered,
        peer.seal("learner", m.TicketRequest(0, 5)),  # authentic, fresh, on a stranger's connection
    ]
    with caplog.at_level(logging.WARNING, logger="jaxrl_async.runtime.transport"):
        for frames in hostile:
            stranger.send_multipart(frames)
        _settle(hub, len(hostile))
        peer._sock.send_multipart(real)  # the same replay on the peer's own connection
        _settle(hub, len(hostile) + 1)
    assert hub.rejected == len(hostile) + 1, hub.rejected_reasons
    assert not os.path.exists(marker)  # nothing was unpickled
    reasons = hub.rejected_reasons
    for why in ("replayed", "from another run", "bad MAC", "oversized", "malformed"):
        assert reasons[why] >= 1, reasons
    dropped = [r for r in caplog.records if "dropped a message from 127.0.0.1" in r.getMessage()]
    assert len(dropped) == 1  # once per peer address, however many
    # The hub works on: a legitimate message still gets through, both ways.
    peer.send("learner", m.Rollouts(0, [[_rollout(1, 0)]], m.ActorStats.empty()))
    got = _recv(hub, "learner")
    assert _same(got, [m.Rollouts(0, [[_rollout(1, 0)]], m.ActorStats.empty())])
    hub.send("actor:0", m.Stop())
    assert _recv(peer, "actor:0") == [m.Stop()]
    for t in (other_run, other_secret):
        t.close()
    stranger.close()


def test_a_frame_over_the_size_cap_drops_only_its_connection(hub_and_peer):
    hub, peer = hub_and_peer
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(f"tcp://{hub.address.partition('#')[0]}")
    stranger.send(b"z" * (2 << 20))  # one frame over MAXMSGSIZE: libzmq closes that connection unread
    time.sleep(0.3)
    hub.recv("learner")
    peer.send("learner", m.TicketRequest(0, 1))
    assert _recv(hub, "learner") == [m.TicketRequest(0, 1)]
    stranger.close()


def test_the_hub_binds_no_wildcard_and_impostors_get_no_route():
    with pytest.raises(ValueError, match="not '0.0.0.0'"):
        ZmqTransport(["learner"], True, "0.0.0.0", 0, SECRET)
    hub = ZmqTransport(["learner", "hello"], True, "127.0.0.1", 0, SECRET)
    hub.route("actor:0", 1)
    impostor = ZmqTransport(["actor:0"], False, hub.address, 2, SECRET)  # right secret, not in the run
    impostor.send("hello", m.Hello(2))
    _settle(hub, 1)
    assert hub.rejected == 1 and hub.recv("hello") == []
    hub.send("actor:0", m.Stop())  # held until process 1 says Hello (no one else gets it)
    peer = ZmqTransport(["actor:0"], False, hub.address, 1, SECRET)
    peer.send("hello", m.Hello(1))
    assert _recv(hub, "hello") == [m.Hello(1)]
    assert _recv(peer, "actor:0") == [m.Stop()]
    for t in (impostor, peer, hub):
        t.close()


# ----- the secret ---------------------------------------------------------------------------------------


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path):
    path = str(tmp_path / "s")
    secret.write_file(path, "k" * 40)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    env = {secret.ENV_SECRET_FILE: path, secret.ENV_SECRET: "e" * 40}
    assert secret.load(env) == b"k" * 40 and secret.ENV_SECRET not in env  # children do not inherit it
    os.chmod(path, 0o644)
    with pytest.raises(secret.SecretError, match="chmod 600"):
        secret.load({secret.ENV_SECRET_FILE: path})
    with pytest.raises(secret.SecretError, match="at least 32"):
        secret.load({secret.ENV_SECRET: "short"})
    with pytest.raises(secret.SecretError, match="JAXRL_SECRET_FILE=.*JAXRL_SECRET="):
        secret.load({})


def test_a_multi_process_run_without_a_secret_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRL_")}
    env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), "--config=configs/tiny_arith.py",
           "--config.workdir=/nonexistent/never", "--coordinator_address=127.0.0.1:1", "--num_processes=2",
           "--process_id=0", "--config.mesh.trainer_processes=(0,)",
           "--config.mesh.sampler_processes=(1,)"]  # fmt: skip
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "needs a secret" in res.stderr and "JAXRL_SECRET_FILE" in res.stderr, res.stderr[-2000:]
    assert "could not join" not in res.stderr  # refused before connecting
