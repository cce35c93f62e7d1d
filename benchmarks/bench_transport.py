"""What crosses between processes, measured: weights (the transfer server) and rollouts (ZeroMQ), against
local copies of the same bytes.

  python -m benchmarks.bench_transport --preset llama_100m --reps 5 --out /tmp/transport.json

Starts two JAX processes on localhost (one CPU device each; process 0 plays the trainer, process 1 the
sampler) and moves the model's parameters from one to the other every repetition with
`jaxrl_async.runtime.weight_sync`: the trainer casts its shards into a fresh copy and offers them
(`jax.experimental.transfer.await_pull`), the sampler pulls them and lays them out. Reports the median
seconds on the sampler side (GB/s) and on the trainer side (what the trainer's loop pays per version),
and the sampler device's live buffer bytes after the last pull, beside `numpy` copying the same bytes
and, in one process of 4 CPU devices, `jax.device_put`, the one-process runs' `WeightSync` (shard
routes; its trainer stall is the dispatch) and an on-device copy, 1 -> 1 device and fsdp (2,1) -> tensor
(1,2). Then the sampler sends train batches of rollouts (`--samples` completions
of `--tokens` tokens each, as the actor does) to the learner lead's ZeroMQ hub: median seconds per batch
from send to receipt, and MB/s of the pickled messages.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

from absl import flags

from jaxrl_async.cli import module_command, run_command

# The directory holding this `jaxrl_async`: the worker processes import the same package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout

_PRESET = flags.DEFINE_string("preset", "llama_100m", "Model shape (jaxrl_async.model.presets).")
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions (medians are reported).", lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples", 512, "Completions per rollout batch (a multiple of 8).", 8)
_TOKENS = flags.DEFINE_integer("tokens", 1024, "Tokens per completion.", lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Also write the JSON here.")
_CODEC = flags.DEFINE_bool("codec", False, "Only time the wire format of a rollout batch against pickle.")
# The two worker processes this command starts get these; a user passes none of them.
_ROLE = flags.DEFINE_integer("role", -1, "Internal: the worker's process id (0 trainer, 1 sampler).")
_PORT = flags.DEFINE_integer("port", 0, "Internal: the workers' coordinator port.")
_TMP = flags.DEFINE_string("tmp", "", "Internal: where the workers write their measurements.")
_TRANSPORT = flags.DEFINE_enum("transport", "transfer", ["transfer", "auto"],
                               "Internal: the workers' config.mesh.weight_transport.")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(pid: int, port: int, tmp: str, preset: str, reps: int, samples: int, tokens: int,
            transport: str) -> None:  # fmt: skip
    """One version `reps + 1` times from process 0 (trainer) to process 1 (sampler) over `transport`
    (each version waits at a barrier first, so the sampler's seconds run from the same start as the
    trainer's publish); with "transfer" also a numpy copy of the same bytes and the rollouts' latency."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from jax._src.distributed import global_state

    from jaxrl_async.model import init_params, presets
    from jaxrl_async.runtime import codec, secret
    from jaxrl_async.runtime.cluster import Cluster, Roles
    from jaxrl_async.runtime.messages import ActorStats, Hello, Rollouts
    from jaxrl_async.runtime.transport import ZmqTransport
    from jaxrl_async.runtime.weight_sync import TransferPublisher, TransferReceiver
    from jaxrl_async.sharding import TRAINER_RULES, make_mesh

    cluster = Cluster(Roles(2, (1,), (0,)), pid, global_state.client)
    cfg = presets.get(preset, vocab_size=32000 if preset != "tiny" else 64)
    devices = jax.devices()
    t_mesh = make_mesh((1, 1), ("fsdp", "tensor"), [devices[0]])
    s_mesh = make_mesh((1, 1), ("data", "tensor"), [devices[1]])
    out: dict = {"preset": preset}
    if pid == 0:
        params = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        pub = TransferPublisher(cluster, cfg, t_mesh, (1, 1), cfg.param_dtype, num_actors=1,
                                transport=transport)  # fmt: skip
        trainer_s = []
        for v in range(reps + 1):
            cluster.barrier(f"transfer_{v}")
            t0 = time.perf_counter()
            pub.publish(v, params)
            trainer_s.append(time.perf_counter() - t0)
            cluster.barrier(f"pulled_{v}")
        cluster.barrier("extra")  # one more version, untimed: the receiver counts its live buffers
        pub.publish(reps + 1, params)
        cluster.barrier("extra_pulled")
        out.update(bytes=nbytes, transfer_trainer_s=trainer_s[1:],
                   shared_bytes=len(pub.writer.slots) * pub.writer.nbytes if pub.writer else 0)  # fmt: skip
        pub.close()
        if transport != "transfer":
            _dump(out, tmp, transport, pid, cluster)
            return
        host = jax.tree.map(np.asarray, params)
        copies = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.tree.map(np.copy, host)
            copies.append(time.perf_counter() - t0)
        warm = jax.tree.map(np.copy, host)  # the destination's pages touched once, as a reused slot's are
        warm_s = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.tree.map(np.copyto, warm, host)
            warm_s.append(time.perf_counter() - t0)
        out.update(memcpy_s=copies, warm_memcpy_s=warm_s)
        hub = ZmqTransport(["learner", "hello"], True, "127.0.0.1", 0, secret.load())
        hub.route("actor:0", 1)
        cluster.publish("hub", hub.address)
        while not hub.recv("hello"):
            hub.wait(0.05)
        received = []
        for _ in range(reps + 1):
            got = []
            while not got:
                hub.wait(0.01)
                got = hub.recv("learner")
            stamp = got[0].groups[0][0].metadata  # the send time travels in the first rollout
            received.append((time.perf_counter(), stamp["sent"], stamp["bytes"]))
        out.update(rollout_s=[t - sent for t, sent, _ in received[1:]], rollout_bytes=received[0][2])
        hub.close()
    else:
        recv = TransferReceiver(cluster, 0, cfg, t_mesh, s_mesh, cfg.param_dtype, transport=transport)
        from jaxrl_async.runtime.messages import NewWeights

        pulled = []
        for v in range(reps + 1):
            cluster.barrier(f"transfer_{v}")
            t0 = time.perf_counter()
            last = recv.receive(NewWeights(v))
            pulled.append(time.perf_counter() - t0)
            cluster.barrier(f"pulled_{v}")
        import gc

        def device_bytes() -> int:
            gc.collect()
            live = {(a.unsafe_buffer_pointer(), a.nbytes) for x in jax.live_arrays() for a in
                    (s.data for s in x.addressable_shards) if a.device == devices[1]}  # fmt: skip
            return sum(n for _, n in live)

        held = device_bytes()  # the last version received (`last`) and nothing else
        cluster.barrier("extra")
        incoming = recv.start(NewWeights(reps + 1))  # the pieces on their way or landed
        landed = device_bytes()
        new = recv.finish(incoming)  # laid out, the pieces still referenced
        laid = device_bytes()
        cluster.barrier("extra_pulled")
        path = "shm" if recv.readers else "transfer"
        out.update(transfer_sampler_s=pulled[1:], receiver_bytes=held,
                   peak_extra_bytes=max(landed, laid) - held, path=path)  # fmt: skip
        del last, incoming, new
        if transport != "transfer":
            _dump(out, tmp, transport, pid, cluster)
            return
        batch = _rollout_batch(samples, tokens)
        batch[0][0].metadata.update(sent=0.0, bytes=0)
        size = sum(map(len, codec.encode("learner", Rollouts(0, batch, ActorStats.empty()))))
        actor = ZmqTransport(["actor:0"], False, cluster.lookup("hub"), 1, secret.load())
        actor.send("hello", Hello(1))
        for _ in range(reps + 1):
            time.sleep(0.2)  # one batch at a time: the latency of each
            batch[0][0].metadata.update(sent=time.perf_counter(), bytes=size)
            actor.send("learner", Rollouts(0, batch, ActorStats.empty()))
        time.sleep(1.0)
        actor.close()
    _dump(out, tmp, transport, pid, cluster)


def _dump(out: dict, tmp: str, transport: str, pid: int, cluster) -> None:
    with open(f"{tmp}/weight_sync_{transport}_{pid}.json", "w") as f:
        json.dump(out, f)
    cluster.barrier("end")


def _rollout_batch(samples: int, tokens: int) -> list:
    """A train batch as the actor sends it: `samples` completions of `tokens` tokens, in groups of 8."""
    import numpy as np

    from jaxrl_async.rollouts import Rollout

    rng = np.random.default_rng(0)
    return [
        [
            Rollout(
                uid=f"0:{g}", group_id=g, sample_index=i,
                prompt_tokens=rng.integers(0, 1000, 256, dtype=np.int32),
                completion_tokens=rng.integers(0, 1000, tokens, dtype=np.int32),
                behav_logprobs=rng.standard_normal(tokens).astype(np.float32),
                versions=np.zeros(tokens, np.int32), reward=1.0, finish_reason="stop",
                metadata={"text": "x" * tokens * 3, "prompt": "p" * 600, "reason": "ok"},
            )
            for i in range(8)
        ]
        for g in range(samples // 8)
    ]  # fmt: skip


def codec_cost(samples: int, tokens: int, reps: int) -> dict:
    """Median milliseconds to encode and decode one rollout batch: pickle (what crossed before) against
    the codec with its HMAC-SHA256 (sender: encode + sign; hub: verify + decode), in this process."""
    import pickle

    import zmq

    from jaxrl_async.runtime import secret
    from jaxrl_async.runtime.messages import ActorStats, Rollouts
    from jaxrl_async.runtime.transport import ZmqTransport

    message = Rollouts(0, _rollout_batch(samples, tokens), ActorStats.empty())
    key = secret.generate().encode()
    hub = ZmqTransport(["learner"], True, "127.0.0.1", 0, key)
    hub.route("actor:0", 1)
    peer = ZmqTransport(["actor:0"], False, hub.address, 1, key)
    times: dict[str, list[float]] = {k: [] for k in ("pickle_dump", "pickle_load", "seal", "open")}
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        data = pickle.dumps(("learner", message), protocol=5)
        t1 = time.perf_counter()
        pickle.loads(data)
        t2 = time.perf_counter()
        frames = peer.seal("learner", message)
        t3 = time.perf_counter()
        hub.open([zmq.Frame(f, copy=False) for f in frames])
        t4 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(dt * 1e3)
    peer.close()
    hub.close()
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    out.update(pickle_bytes=len(data), wire_bytes=sum(map(len, frames)), samples=samples, tokens=tokens)
    print(f"\none rollout batch ({samples} completions x {tokens} tokens), median of {reps}, in ms:\n")
    print("| format | MB | send side | receive side | total |\n|---|---|---|---|---|")
    for name, mb, a, b in (("pickle", out["pickle_bytes"], out["pickle_dump"], out["pickle_load"]),
                           ("codec + HMAC", out["wire_bytes"], out["seal"], out["open"])):  # fmt: skip
        print(f"| {name} | {mb / 1e6:.1f} | {a:.1f} | {b:.1f} | {a + b:.1f} |")
    ratio = (out["seal"] + out["open"]) / (out["pickle_dump"] + out["pickle_load"])
    print(f"\ncodec + HMAC / pickle: {ratio:.2f}x")
    return {**out, "ratio": ratio}


_ONE_PROCESS = """
import json, statistics, time, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 4)
from jaxrl_async.model import init_params, param_shardings, presets
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh
cfg = presets.get(PRESET, vocab_size=32000 if PRESET != "tiny" else 64)
d, reps, out = jax.devices(), REPS, {}
def med(fn):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
layouts = (("1 -> 1 device", (1, 1), (1, 1)), ("fsdp (2,1) -> tensor (1,2)", (2, 1), (1, 2)))
for name, t_shape, s_shape in layouts:
    nt, ns = t_shape[0] * t_shape[1], s_shape[0] * s_shape[1]
    t_mesh = make_mesh(t_shape, ("fsdp", "tensor"), d[:nt])
    s_mesh = make_mesh(s_shape, ("data", "tensor"), d[nt : nt + ns])
    p = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    sync = WeightSync(cfg, s_mesh)
    out[f"device_put {name}"] = {"seconds": med(lambda: jax.device_put(p, sync.shardings))}
    stall = []
    def routed():
        t0 = time.perf_counter(); o = sync(p, wait=False); stall.append(time.perf_counter() - t0); return o
    seconds = med(routed)
    out[f"WeightSync shard routes {name}"] = {"seconds": seconds, "trainer_seconds": statistics.median(stall)}
    if nt == 1:
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
        out["on-device copy (one device)"] = {"seconds": med(lambda: copy(p))}
print(json.dumps(out))
"""


def _one_process(preset: str, reps: int) -> dict:
    """Median seconds of the one-process weight paths (`jax.device_put`, `WeightSync`, an on-device copy)
    on 4 CPU devices of one process, with the trainer's stall per version for `WeightSync`."""
    code = _ONE_PROCESS.replace("PRESET", repr(preset)).replace("REPS", str(reps))
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv) -> None:
    del argv
    preset, reps, samples, tokens = _PRESET.value, _REPS.value, _SAMPLES.value, _TOKENS.value
    if _CODEC.value:
        out = codec_cost(samples, tokens, reps)
        if _OUT.value:
            with open(_OUT.value, "w") as f:
                json.dump(out, f, indent=2)
        return None
    if _ROLE.value >= 0:
        return _worker(_ROLE.value, _PORT.value, _TMP.value, preset, reps, samples, tokens, _TRANSPORT.value)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)
        env.setdefault("JAXRL_SECRET", secrets.token_hex(32))  # the hub's messages are signed
        for transport in ("transfer", "auto"):  # a pair of worker processes each
            port = _free_port()
            procs = [
                subprocess.Popen(
                    module_command("benchmarks.bench_transport", f"--role={i}", f"--port={port}",
                                   f"--tmp={tmp}",
                                   f"--preset={preset}", f"--reps={reps}", f"--samples={samples}",
                                   f"--tokens={tokens}", f"--transport={transport}"),
                    env=env,
                )  # fmt: skip
                for i in range(2)
            ]
            codes = [proc.wait(timeout=1800) for proc in procs]
            if any(codes):
                raise SystemExit(f"worker processes ({transport}) failed: {codes}")
        got = {(t, pid): json.load(open(f"{tmp}/weight_sync_{t}_{pid}.json"))
               for t in ("transfer", "auto") for pid in (0, 1)}  # fmt: skip
    trainer, sampler = got[("transfer", 0)], got[("transfer", 1)]
    shm_trainer, shm_sampler = got[("auto", 0)], got[("auto", 1)]
    if shm_sampler["path"] != "shm":
        raise SystemExit("weight_transport='auto' did not take shared memory on this host (no /dev/shm?)")
    med = statistics.median
    gb = trainer["bytes"] / 1e9
    memcpy = med(trainer["memcpy_s"])
    rows = {
        "numpy copy (one process)": (memcpy, None, None),
        "numpy copy into memory touched before (one process)": (med(trainer["warm_memcpy_s"]), None, None),
        **{f"{k} (one process)": (v["seconds"], v.get("trainer_seconds"), None)
           for k, v in _one_process(preset, reps).items()},
        "transfer pull (two processes)": (
            med(sampler["transfer_sampler_s"]), med(trainer["transfer_trainer_s"]),
            (sampler["receiver_bytes"], sampler["peak_extra_bytes"]),
        ),
        "shared-memory slots (two processes, one host)": (
            med(shm_sampler["transfer_sampler_s"]), med(shm_trainer["transfer_trainer_s"]),
            (shm_sampler["receiver_bytes"], shm_sampler["peak_extra_bytes"]),
        ),
    }  # fmt: skip
    out = {"preset": preset, "gbytes": gb, "reps": reps, "rows": {}}
    print(f"\n{preset}: {gb:.3f} GB of parameters, median of {reps}\n")
    print("| path | seconds (receiver) | GB/s | x memcpy time | trainer stall per version (s) | receiver "
          "live after (GB) | receiver peak extra during a receive (GB) |")
    print("|---|---|---|---|---|---|---|")
    for name, (s, t, mem) in rows.items():
        live, peak = mem if mem is not None else (None, None)
        out["rows"][name] = {"seconds": s, "gb_per_s": gb / s, "x_memcpy": s / memcpy, "trainer_seconds": t,
                             "receiver_live_bytes": live, "receiver_peak_extra_bytes": peak}  # fmt: skip
        cells = ["" if t is None else f"{t:.4f}"]
        cells += ["" if v is None else f"{v / 1e9:.3f}" for v in (live, peak)]
        print(f"| {name} | {s:.4f} | {gb / s:.2f} | {s / memcpy:.2f} | {' | '.join(cells)} |")
    out["shared_memory_bytes"] = shm_trainer["shared_bytes"]
    print(f"\nshared-memory slots in use: {shm_trainer['shared_bytes'] / 1e9:.3f} GB (the receiver's arrays "
          "are views of one of them: it holds no copy of its own)")  # fmt: skip
    mb = trainer["rollout_bytes"] / 1e6
    roll = med(trainer["rollout_s"])
    out["rollouts"] = {"mbytes": mb, "seconds": roll, "mb_per_s": mb / roll, "samples": samples}
    print(f"\nrollouts over ZeroMQ: {samples} completions x {tokens} tokens = {mb:.1f} MB encoded; "
          f"median {roll * 1e3:.1f} ms per batch ({mb / roll:.0f} MB/s)")  # fmt: skip
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_transport`: how the workers start
    run()
