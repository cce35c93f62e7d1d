"""One process of bench_lora's two-process sync measurement (not run by hand: bench_lora --mode=sync starts
two): process 0 trains (publishes), process 1 samples (receives), one CPU device each, on localhost.

  python -m benchmarks.lora_sync_worker PID PORT OUT TRANSPORT PRESET RANK REPS

Every version is published whole (`TransferPublisher`) and as adapters (`LoraPublisher`, whose first
version also offers the base), alternately. Per version: the publisher's seconds (cut, cast and offer,
or the shared-memory write) and, once it has published (a coordination-service barrier, outside the
timings), the receiver's (pull or map, and lay out, to the last byte on its device), and the bytes the
receiver counted. Version 0 (compiles; the LoRA base) is reported apart. Process 1 writes OUT (JSON).
"""

from __future__ import annotations

import json
import sys
import time

import jax


def main(pid: int, port: int, out: str, transport: str, preset: str, rank: int, reps: int) -> None:
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jax._src.distributed import global_state

    from jaxrl_async.model import init_params, presets
    from jaxrl_async.model import lora as lora_lib
    from jaxrl_async.runtime.cluster import Cluster, Roles
    from jaxrl_async.runtime.lora_sync import LoraPublisher, LoraReceiver
    from jaxrl_async.runtime.messages import NewWeights
    from jaxrl_async.runtime.weight_sync import TransferPublisher, TransferReceiver
    from jaxrl_async.sharding import TRAINER_RULES, make_mesh, tree_shardings

    cluster = Cluster(Roles(2, (1,), (0,)), pid, global_state.client)
    cfg = presets.get(preset, dtype="float32", param_dtype="float32")
    lora = lora_lib.LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank, init="normal")
    t_mesh = make_mesh((1, 1), ("fsdp", "tensor"), [d for d in jax.devices() if d.process_index == 0])
    s_mesh = make_mesh((1, 1), ("data", "tensor"), [d for d in jax.devices() if d.process_index == 1])
    names = ("full", "adapters")
    if pid == 0:
        base = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
        specs = lora_lib.adapter_specs(cfg, lora)
        shardings = tree_shardings(specs, t_mesh, TRAINER_RULES)
        adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1), shardings)
        full = TransferPublisher(cluster, cfg, t_mesh, (1, 1), cfg.dtype, 1, transport=transport)
        low = LoraPublisher(cluster, cfg, lora, t_mesh, (1, 1), 1, base, transport=transport)
        ends = {"full": (full, base), "adapters": (low, adapters)}
        for pub, _ in ends.values():
            pub.resolve_paths()
    else:
        ends = {"full": TransferReceiver(cluster, 0, cfg, t_mesh, s_mesh, cfg.dtype, transport=transport),
                "adapters": LoraReceiver(cluster, 0, cfg, lora, t_mesh, s_mesh, transport=transport)}
    times: dict = {n: {"publish_s": [], "receive_s": [], "bytes": []} for n in names}
    for v in range(reps + 1):
        for name in names:
            if pid == 0:
                pub, params = ends[name]
                t0 = time.perf_counter()
                pub.publish(v, params)
                times[name]["publish_s"].append(time.perf_counter() - t0)
                cluster.barrier(f"{name}/{v}/published")
            else:
                cluster.barrier(f"{name}/{v}/published")
                t0 = time.perf_counter()
                got = jax.block_until_ready(ends[name].receive(NewWeights(v)))
                times[name]["receive_s"].append(time.perf_counter() - t0)
                times[name]["bytes"].append(int(ends[name].last_bytes))
                del got
            cluster.barrier(f"{name}/{v}/received")
    res = {"pid": pid, "times": times}
    if pid == 1:
        res["base_bytes"] = ends["adapters"].base_bytes
        res["paths"] = {n: "shm" if _path(ends[n]) else "transfer" for n in names}
    # the publisher's seconds go to the receiver's file through the coordination service
    if pid == 0:
        cluster.publish("bench/publish", json.dumps(times))
    else:
        sent = json.loads(cluster.lookup("bench/publish", 600))
        for n in names:
            times[n]["publish_s"] = sent[n]["publish_s"]
        with open(out, "w") as f:
            json.dump(res, f)
    cluster.barrier("end")


def _path(receiver) -> bool:
    """Whether `receiver` takes its versions from shared memory."""
    inner = getattr(receiver, "adapters", receiver)
    return bool(inner.readers)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2], a[3], a[4], int(a[5]), int(a[6]))
