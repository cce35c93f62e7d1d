"""Cross-process weight sync, measured: the transfer server that multi-process runs use, against local
copies of the same bytes.

  python tools/bench_weight_sync.py --preset llama_100m --reps 5 --out /tmp/weight_sync.json

Starts two JAX processes on localhost (one CPU device each; process 0 plays the trainer, process 1 the
sampler) and moves the model's parameters from one to the other every repetition with
`jaxrl_async.weight_sync`: the trainer casts its shards into a fresh copy and offers them
(`jax.experimental.transfer.await_pull`), the sampler pulls them and lays them out. Reports the median
seconds on the sampler side (GB/s) and on the trainer side (what the trainer's loop pays per version),
beside `numpy` copying the same bytes and `jax.device_put` between two devices of one process (the
one-process runs' weight sync).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(args) -> None:
    pid = args.role
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=pid)
    import numpy as np
    from jax._src.distributed import global_state

    from jaxrl_async.cluster import Cluster, Roles
    from jaxrl_async.model import init_params, presets
    from jaxrl_async.sharding import TRAINER_RULES, make_mesh
    from jaxrl_async.weight_sync import TransferPublisher, TransferReceiver

    cluster = Cluster(Roles(2, (1,), (0,)), pid, global_state.client)
    cfg = presets.get(args.preset, vocab_size=32000 if args.preset != "tiny" else 64)
    devices = jax.devices()
    t_mesh = make_mesh((1, 1), ("fsdp", "tensor"), [devices[0]])
    s_mesh = make_mesh((1, 1), ("data", "tensor"), [devices[1]])
    out: dict = {"preset": args.preset}
    if pid == 0:
        params = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        pub = TransferPublisher(cluster, cfg, t_mesh, cfg.param_dtype, num_actors=1)
        trainer_s = []
        for v in range(args.reps + 1):
            cluster.barrier(f"transfer_{v}")
            t0 = time.perf_counter()
            pub.publish(v, params)
            trainer_s.append(time.perf_counter() - t0)
            cluster.barrier(f"pulled_{v}")
        host = jax.tree.map(np.asarray, params)
        copies = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.tree.map(np.copy, host)
            copies.append(time.perf_counter() - t0)
        out.update(bytes=nbytes, transfer_trainer_s=trainer_s[1:], memcpy_s=copies)
    else:
        recv = TransferReceiver(cluster, 0, cfg, t_mesh, s_mesh, cfg.param_dtype)
        from jaxrl_async.transport import NewWeights

        pulled = []
        for v in range(args.reps + 1):
            cluster.barrier(f"transfer_{v}")
            t0 = time.perf_counter()
            recv.receive(NewWeights(v))
            pulled.append(time.perf_counter() - t0)
            cluster.barrier(f"pulled_{v}")
        out.update(transfer_sampler_s=pulled[1:])
    with open(f"{args.tmp}/weight_sync_{pid}.json", "w") as f:
        json.dump(out, f)
    cluster.barrier("end")


def _local_device_put(preset: str, reps: int) -> float:
    """Median seconds of `jax.device_put` of the parameters between two devices of one process."""
    code = f"""
import time, statistics, jax
jax.config.update("jax_num_cpu_devices", 2)
from jaxrl_async.model import init_params, param_shardings, presets
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh
cfg = presets.get({preset!r}, vocab_size=32000 if {preset!r} != "tiny" else 64)
d = jax.devices()
p = init_params(cfg, jax.random.key(0), make_mesh((1, 1), ("fsdp", "tensor"), [d[0]]), TRAINER_RULES)
t = param_shardings(cfg, make_mesh((1, 1), ("data", "tensor"), [d[1]]), SAMPLER_RULES)
ts = []
for _ in range({reps} + 1):
    t0 = time.perf_counter(); jax.block_until_ready(jax.device_put(p, t)); ts.append(time.perf_counter() - t0)
print(statistics.median(ts[1:]))
"""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama_100m")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--role", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role >= 0:
        return _worker(args)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    f"--role={i}",
                    f"--port={port}",
                    f"--tmp={tmp}",
                    f"--preset={args.preset}",
                    f"--reps={args.reps}",
                ],
                env=env,
            )  # fmt: skip
            for i in range(2)
        ]
        codes = [proc.wait(timeout=1800) for proc in procs]
        if any(codes):
            raise SystemExit(f"worker processes failed: {codes}")
        trainer = json.load(open(f"{tmp}/weight_sync_0.json"))
        sampler = json.load(open(f"{tmp}/weight_sync_1.json"))
    med = statistics.median
    gb = trainer["bytes"] / 1e9
    local_put = _local_device_put(args.preset, args.reps)
    rows = {
        "transfer (pull)": (med(sampler["transfer_sampler_s"]), med(trainer["transfer_trainer_s"])),
        "numpy copy (one process)": (med(trainer["memcpy_s"]), None),
        "device_put (two devices, one process)": (local_put, None),
    }
    out = {"preset": args.preset, "gbytes": gb, "reps": args.reps, "rows": {}}
    print(f"\n{args.preset}: {gb:.3f} GB of parameters, median of {args.reps}\n")
    print("| method | seconds (receiver) | GB/s | trainer seconds per sync |\n|---|---|---|---|")
    for name, (s, t) in rows.items():
        out["rows"][name] = {"seconds": s, "gb_per_s": gb / s, "trainer_seconds": t}
        print(f"| {name} | {s:.4f} | {gb / s:.2f} | {'' if t is None else f'{t:.4f}'} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
