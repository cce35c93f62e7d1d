"""What a sampler replica that spans processes pays per decode call, measured on localhost.

  python -m benchmarks.bench_replica --requests 64 --out /tmp/replica.json

Runs one continuous-batching workload (greedy, `--slots` slots, `--steps-per-call` decode steps per call,
`--requests` prompts of 8 tokens, 2 arriving per loop step, up to 24 new tokens each) on a (2, 2) sampler
mesh two ways:

  * one process with 4 CPU devices (the mesh as one process sees it);
  * two processes with 2 CPU devices each, the replica's leader and its member
    (`jaxrl_async.runtime.replica`): before each loop step the leader sends the member a `MemberStep`
    (with the requests queued since the last one) over the replica's signed ZeroMQ channel, and both run
    the same prefill / insert / generate programs, whose round of tokens the engine gathers onto every
    device.

Reports the median seconds per loop step of each, the bytes of the commands on the wire (the four frames
of `ZmqTransport.seal`: header, codec body, array bytes, MAC; with and without queued requests), the bytes
of one round gathered across the replica, and two ways to tell the member a command (median of
`--pings` each, after the workload): a round trip of a `MemberStep` with 2 requests over the replica's
channel, and `jax.experimental.multihost_utils.broadcast_one_to_all` of the same bytes (a JAX
collective over the processes). A model of `--preset`'s shape with random weights; the token ids of
both ways are compared.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import tempfile
import time

from absl import flags

from jaxrl_async.cli import command_env, module_command, run_command

_PRESET = flags.DEFINE_string("preset", "tiny", "Model shape (jaxrl_async.model.presets).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Sampler slots (a multiple of the mesh's data axis, 2).", 2)
_SPC = flags.DEFINE_integer("steps-per-call", 4, "Decode steps per generate call.", lower_bound=1)
_REQUESTS = flags.DEFINE_integer("requests", 64, "Prompts decoded (8 tokens each, up to 24 new).", 1)
_PINGS = flags.DEFINE_integer("pings", 200, "Round trips timed per way of sending a command.", 1)
_OUT = flags.DEFINE_string("out", "", "Also write the JSON here.")
_ROLE = flags.DEFINE_integer("role", -1, "Internal: the worker's process id (2: the one-process run).")
_PORT = flags.DEFINE_integer("port", 0, "Internal: the workers' coordinator port.")
_TMP = flags.DEFINE_string("tmp", "", "Internal: where the workers write their measurements.")

MAX_NEW, PROMPT, ARRIVALS, PAD = 24, 8, 2, 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(n: int, vocab: int):
    import numpy as np

    from jaxrl_async.sampler import Request

    rng = np.random.default_rng(0)
    return [Request(i, tuple(rng.integers(0, vocab, PROMPT).tolist()), 1, i, MAX_NEW) for i in range(n)]


def _engine():
    import jax

    from jaxrl_async.model import init_params, presets
    from jaxrl_async.sampler import Engine, SamplerConfig
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

    cfg = presets.get(_PRESET.value, vocab_size=64 if _PRESET.value == "tiny" else 32000)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = make_mesh((2, 2), ("data", "tensor"), devices)
    params = init_params(cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    kernels = dict(temperature=0.0, attention="xla", linear="xla")
    scfg = SamplerConfig(num_slots=_SLOTS.value, max_prompt_len=PROMPT, max_new_tokens=MAX_NEW,
                         steps_per_call=_SPC.value, **kernels)  # fmt: skip
    return cfg, Engine(cfg, params, mesh, scfg)


def _worker(pid: int, port: int, tmp: str) -> None:
    import jax

    alone = pid == 2
    jax.config.update("jax_num_cpu_devices", 4 if alone else 2)
    if not alone:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jaxrl_async.runtime import secret
    from jaxrl_async.runtime.cluster import Cluster, Roles

    cfg, engine = _engine()
    cluster = key = None
    if not alone:
        from jax._src.distributed import global_state

        cluster = Cluster(Roles(2, (0,), (0,), ((0, 1),)), pid, global_state.client)
        key = secret.load()
    if pid == 1:
        return _member(cluster, engine, key)
    _leader(cluster, engine, key, cfg.vocab_size, tmp, pid)


def _member(cluster, engine, key) -> None:
    """Replays the leader's workload, then echoes its timed commands and joins its broadcasts."""
    from jaxrl_async.runtime.replica import LEADER, ReplicaMember

    member = ReplicaMember(cluster, 0, engine, None, [], None, False, key)
    while not member.done:
        if not member.poll():
            member.wait(0.01)
    echoed = 0
    while echoed < _PINGS.value:
        for m in member.channel.recv(member.endpoint):
            member.channel.send(LEADER, m)
            echoed += 1
        member.wait(0.01)
    _broadcasts(None)
    cluster.barrier("bench_end")
    member.close()


def _broadcasts(payload: bytes | None) -> list[float]:
    """Seconds per `broadcast_one_to_all` of `payload` (padded to PAD bytes) from process 0."""
    import numpy as np
    from jax.experimental import multihost_utils

    x = np.zeros(PAD, np.uint8)
    if payload is not None:
        if len(payload) > PAD:
            raise ValueError(f"a command of {len(payload)} bytes: more than the {PAD} broadcast")
        x[: len(payload)] = np.frombuffer(payload, np.uint8)
    out = []
    for _ in range(_PINGS.value):
        t0 = time.perf_counter()
        np.asarray(multihost_utils.broadcast_one_to_all(x))
        out.append(time.perf_counter() - t0)
    return out


def _leader(cluster, engine, key, vocab: int, tmp: str, pid: int) -> None:
    from jaxrl_async.runtime.messages import MemberStep
    from jaxrl_async.runtime.replica import LEADER, Members, as_member_request
    from jaxrl_async.sampler import SamplerLoop

    members = Members(cluster, 0, (1,), key) if cluster is not None else None
    loop = SamplerLoop(engine)
    todo = _requests(_REQUESTS.value, vocab)
    out: dict = {"step_s": [], "frame_bytes": [], "tokens": {}}
    example = None
    while todo or not loop.idle:
        t0 = time.perf_counter()
        queued = []
        for r in todo[:ARRIVALS]:  # a few prompts arrive per step, as the coordinator grants them
            loop.add_request(r)
            queued.append(as_member_request(r))
            if members is not None:
                members.queue(r)
        del todo[:ARRIVALS]
        if members is not None:
            command = MemberStep(members.calls, queued, False)
            out["frame_bytes"].append(sum(len(f) for f in members.channel.seal("member:1", command)))
            example = command if len(queued) == ARRIVALS else example
            members.step(evaluate=False)
        for c in loop.step():
            out["tokens"][int(c.uid)] = c.tokens.tolist()
        out["step_s"].append(time.perf_counter() - t0)
    # A round: tokens int32, logprobs and sample_logprobs float32, valid bool [k, B]; done bool [B].
    out["round_bytes"] = _SPC.value * _SLOTS.value * (4 + 4 + 4 + 1) + _SLOTS.value
    if members is not None:
        out["messages"] = members.messages
        members.stop()
        rtt = []
        for _ in range(_PINGS.value):
            t0 = time.perf_counter()
            members.channel.send("member:1", example)
            while not members.channel.recv(LEADER):
                members.channel.wait(1.0)
            rtt.append(time.perf_counter() - t0)
        out["zmq_round_trip_s"] = rtt
        body = b"".join(bytes(f) for f in members.channel.seal("member:1", example))
        out["broadcast_s"] = _broadcasts(body)
        cluster.barrier("bench_end")
        members.close()
    with open(os.path.join(tmp, f"replica_{pid}.json"), "w") as f:
        json.dump(out, f)


def main(argv) -> None:
    del argv
    if _ROLE.value >= 0:
        return _worker(_ROLE.value, _PORT.value, _TMP.value)
    from jaxrl_async.runtime import secret

    common = [f"--preset={_PRESET.value}", f"--slots={_SLOTS.value}", f"--steps-per-call={_SPC.value}",
              f"--requests={_REQUESTS.value}", f"--pings={_PINGS.value}"]  # fmt: skip
    env = dict(command_env(force_cpu=True), **{secret.ENV_SECRET: secret.generate()})
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        internal = lambda i: [f"--role={i}", f"--port={port}", f"--tmp={tmp}"]
        cmd = lambda i: module_command("benchmarks.bench_replica", *internal(i), *common)
        procs = [subprocess.Popen(cmd(i), env=env) for i in range(2)]
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        codes.append(subprocess.run(cmd(2), env=env, timeout=1800).returncode)
        if any(codes):
            raise SystemExit(f"worker processes failed: {codes}")
        leader, alone = (json.load(open(os.path.join(tmp, f"replica_{i}.json"))) for i in (0, 2))
    skip = min(4, len(leader["step_s"]) - 1)  # the first steps compile
    med = lambda xs: statistics.median(xs[skip:])
    frames = leader["frame_bytes"]
    with_requests = [b for b in frames if b > min(frames)]
    result = {
        "preset": _PRESET.value,
        "loop_steps": len(leader["step_s"]),
        "step_s_replica": med(leader["step_s"]),
        "step_s_one_process": med(alone["step_s"]),
        "messages_per_step": leader["messages"] / len(leader["step_s"]),
        "frame_bytes_empty": min(frames),
        "frame_bytes_with_requests": statistics.median(with_requests) if with_requests else None,
        "round_bytes_gathered": leader["round_bytes"],
        "command_round_trip_s_zmq": statistics.median(leader["zmq_round_trip_s"]),
        "command_broadcast_s_jax": statistics.median(leader["broadcast_s"]),
        "same_tokens": leader["tokens"] == alone["tokens"],
    }
    print(json.dumps(result, indent=2))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(result, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_replica`: how the workers start
    run()
