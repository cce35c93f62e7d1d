"""Across processes the weights go shard to shard, in buckets: each sampler device receives exactly its
blocks, and the values arrive unchanged; each member of a replica that spans processes pulls only its own
devices' blocks; a version whose sender dies ends the receive with a clear error."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import gc, json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid, port, out, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax._src.distributed import global_state
from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime.cluster import Cluster, Roles
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import TransferPublisher, TransferReceiver
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh

cluster = Cluster(Roles(2, (1,), (0,)), pid, global_state.client)
cfg = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
t_devs = [d for d in jax.devices() if d.process_index == 0]
t_mesh = make_mesh((2, 1), ("fsdp", "tensor"), t_devs)
res = {}
BUCKET = 8192  # bytes: the tiny model's version travels in many buckets
if pid == 0:
    params = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    pub = TransferPublisher(cluster, cfg, t_mesh, (1, 2), "bfloat16", num_actors=1, bucket_bytes=BUCKET,
                            transport=transport)
    assert len(pub.buckets) > 4  # several buckets per version
    for v in range(2):
        pub.publish(v, params)
        cluster.barrier(f"pulled_{v}")
else:
    s_mesh = make_mesh((1, 2), ("data", "tensor"), jax.local_devices())
    recv = TransferReceiver(cluster, 0, cfg, t_mesh, s_mesh, "bfloat16", bucket_bytes=BUCKET,
                            transport=transport)
    got = recv.receive(NewWeights(0))
    cluster.barrier("pulled_0")
    del got
    gc.collect()
    parts, _ = recv.pull(NewWeights(1))  # mid-receive: every piece has landed, nothing is laid out yet
    cluster.barrier("pulled_1")
    mid_live = {}
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            mid_live[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    got = jax.tree.unflatten(recv.plan.treedef, recv.assemble(parts))
    del parts
    one = make_mesh((1, 1), ("data", "tensor"), jax.local_devices()[:1])
    want = init_params(cfg, jax.random.key(0), one, SAMPLER_RULES)
    equal = all(np.array_equal(np.asarray(a), np.asarray(b.astype(jax.numpy.bfloat16)))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    del want
    gc.collect()
    shard_bytes = {d.id: 0 for d in s_mesh.devices.flat}
    biggest_block = 0
    for x in jax.tree.leaves(got):
        for s in x.addressable_shards:
            shard_bytes[s.device.id] += s.data.nbytes
            biggest_block = max(biggest_block, s.data.nbytes)
    live = {}
    largest_live = 0
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            live[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
            largest_live = max(largest_live, s.data.nbytes)
    live_bytes = {d: sum(n for (i, _), n in live.items() if i == d) for d in shard_bytes}
    res = dict(mid_live={d: sum(n for (i, _), n in mid_live.items() if i == d) for d in shard_bytes},
               equal=equal, shard_bytes=shard_bytes, live_bytes=live_bytes, pulled=recv.last_bytes,
               full=sum(x.nbytes for x in jax.tree.leaves(got)), biggest_block=biggest_block,
               largest_live=largest_live, shm=sorted(recv.readers), transfer=sorted(recv.conns),
               sharded=[s.data.shape != x.shape for x in jax.tree.leaves(got) for s in x.addressable_shards])
    json.dump(res, open(out, "w"), default=str)
cluster.barrier("end")
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(script: str, n: int, *args: str, timeout: float = 240) -> list[int]:
    """Runs `script` as processes 0..n-1 of a localhost cluster (argv: id, port, *args); their exit codes."""
    port = _port()
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-c", script]
    procs = [subprocess.Popen([*cmd, str(i), str(port), *args], env=env) for i in range(n)]
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("transport", ["auto", "transfer"])
def test_receiver_gets_exactly_its_blocks(tmp_path, transport):
    """"auto" on one CPU host: shared-memory slots, mapped in place; "transfer": the transfer server."""
    out = str(tmp_path / "sampler.json")
    codes = _run_processes(WORKER, 2, out, transport)
    assert codes == [0, 0]
    res = json.load(open(out))
    assert res["equal"]
    assert any(res["sharded"])  # the tensor axis splits leaves: there are blocks smaller than the leaf
    # Each device holds exactly its blocks, nothing joined or left behind; the pull moved one version.
    assert res["live_bytes"] == res["shard_bytes"]
    # Mid-receive (pieces landed, not laid out): each device holds only the pieces of its own blocks.
    assert res["mid_live"] == res["shard_bytes"]
    assert res["largest_live"] == res["biggest_block"]
    assert res["pulled"] == res["full"]  # (1, 2): no replicated block, every byte pulled once
    assert (res["shm"], res["transfer"]) == (([0], []) if transport == "auto" else ([], [0]))


CUT_OFF = r"""
import json, os, signal, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid, port, out, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax._src.distributed import global_state
from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime.cluster import Cluster, PeerFailure, Roles
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import TransferPublisher, TransferReceiver, checksum
from jaxrl_async.sharding import TRAINER_RULES, make_mesh

# Process 1 trains (as a trainer follower does: the process that dies is not the one that hosts the
# coordination service, whose death JAX itself answers by terminating every other process).
cluster = Cluster(Roles(2, (0,), (1,)), pid, global_state.client)
cfg = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
t_mesh = make_mesh((2, 1), ("fsdp", "tensor"), [d for d in jax.devices() if d.process_index == 1])
if pid == 1:  # sends version 0, then dies in the middle of version 1
    params = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    pub = TransferPublisher(cluster, cfg, t_mesh, (1, 2), "bfloat16", num_actors=1, bucket_bytes=8192,
                            transport=transport)
    pub.publish(0, params)
    cluster.barrier("pulled_0")
    if transport == "transfer":  # offered, not yet pulled
        pub.publish(1, jax.tree.map(lambda x: x + 1, params))
    else:  # a shared-memory slot taken for version 1, its pieces not all written, the version not stamped
        pub.writer._claim(1)
    open(out + ".offered", "w").write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)
s_mesh = make_mesh((1, 2), ("data", "tensor"), jax.local_devices())
recv = TransferReceiver(cluster, 0, cfg, t_mesh, s_mesh, "bfloat16", bucket_bytes=8192, transport=transport)
assert bool(recv.readers) == (transport == "auto")
held = recv.receive(NewWeights(0))
before = checksum(held)
cluster.barrier("pulled_0")
while not os.path.exists(out + ".offered"):
    time.sleep(0.01)
sender = int(open(out + ".offered").read())
while os.path.exists(f"/proc/{sender}"):  # gone (a zombie until the test reaps it)
    if open(f"/proc/{sender}/stat").read().split()[2] == "Z":
        break
    time.sleep(0.01)
t0 = time.monotonic()
try:
    recv.receive(NewWeights(1))
    res = {"error": None}
except PeerFailure as e:
    res = {"error": str(e)}
res.update(seconds=time.monotonic() - t0, before=before, after=checksum(held))
json.dump(res, open(out, "w"))
os._exit(0)  # the other process is gone: do not wait for the coordination service's shutdown barrier
"""


@pytest.mark.parametrize("transport", ["auto", "transfer"])
def test_a_sync_cut_off_by_a_dead_sender_fails_fast_and_keeps_the_old_version(tmp_path, transport):
    out = str(tmp_path / "sampler.json")
    codes = _run_processes(CUT_OFF, 2, out, transport)
    assert codes == [0, -9]
    res = json.load(open(out))
    # Version 1 was announced but its sender died: the receiver names the version and the trainer
    # process at once (not after the pull's 300 s deadline), and the version it holds is untouched.
    assert "version 1's weights stopped arriving from the trainer processes [1]" in (res["error"] or "")
    assert "the sampler keeps the version it has" in res["error"]
    if transport == "auto":  # the writer's death is seen from its OS process, not from a connection
        assert "the trainer process writing version 1 (OS pid" in res["error"]
    assert res["seconds"] < 30
    assert res["after"] == res["before"]


SPANNING = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=3, process_id=pid)
import numpy as np
from jax._src.distributed import global_state
from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime import shard_routes
from jaxrl_async.runtime.cluster import Cluster, Roles
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import TransferPublisher, TransferReceiver
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh

cluster = Cluster(Roles(3, (1,), (0,), ((1, 2),)), pid, global_state.client)
cfg = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, ffw_size=128)
t_mesh = make_mesh((2, 1), ("fsdp", "tensor"), [d for d in jax.devices() if d.process_index == 0])
# One (1, 4) replica over processes 1 and 2: the tensor axis crosses them, each holds half the columns.
s_devs = sorted((d for d in jax.devices() if d.process_index in (1, 2)),
                key=lambda d: (d.process_index, d.id))
s_mesh = make_mesh((1, 4), ("data", "tensor"), s_devs)
if pid == 0:
    params = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    pub = TransferPublisher(cluster, cfg, t_mesh, (1, 4), "float32", num_actors=2, bucket_bytes=8192,
                            targets={0: (s_mesh, 1), 1: (s_mesh, 2)})
    pub.publish(0, params)
    cluster.barrier("pulled")
else:
    recv = TransferReceiver(cluster, pid - 1, cfg, t_mesh, s_mesh, "float32", bucket_bytes=8192)
    got = recv.receive(NewWeights(0))
    cluster.barrier("pulled")
    one = make_mesh((1, 1), ("data", "tensor"), jax.local_devices()[:1])
    want = [np.asarray(x) for x in jax.tree.leaves(init_params(cfg, jax.random.key(0), one, SAMPLER_RULES))]
    leaves = jax.tree.leaves(got)
    equal = all(np.array_equal(np.asarray(s.data), w[s.index]) for x, w in zip(leaves, want)
                for s in x.addressable_shards)
    mine = sum(int(np.prod([hi - lo for lo, hi in b])) * 4 for x in leaves
               for b, devs in shard_routes.distinct_blocks(x.sharding, x.shape).items()
               if any(d.process_index == pid for d in devs))
    json.dump(dict(equal=equal, pulled=recv.last_bytes, mine=mine, full=sum(x.nbytes for x in leaves)),
              open(f"{out}.{pid}", "w"))
cluster.barrier("end")
"""


def test_members_of_a_spanning_replica_pull_only_their_own_blocks(tmp_path):
    """A (1, 4) replica over two processes: each member pulls exactly the blocks its devices hold (about
    half the model: the tensor axis crosses them), with the right values, and nobody the whole model."""
    out = str(tmp_path / "member")
    codes = _run_processes(SPANNING, 3, out)
    assert codes == [0, 0, 0]
    res = [json.load(open(f"{out}.{pid}")) for pid in (1, 2)]
    for r in res:
        assert r["equal"]
        assert r["pulled"] == r["mine"] < r["full"] * 0.6  # half, plus the replicated leaves (norms)


IDLE_TRAINERS = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=4, process_id=pid)
import numpy as np
from jax._src.distributed import global_state
from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime.cluster import Cluster, Roles
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.runtime.weight_sync import TransferPublisher, TransferReceiver, checksum
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh

cluster = Cluster(Roles(4, (3,), (0, 1, 2)), pid, global_state.client)
# No dimension divides by 3: the (3, 1) fsdp mesh replicates every leaf and process 0 cuts every piece.
cfg = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
t_mesh = make_mesh((3, 1), ("fsdp", "tensor"), [d for d in jax.devices() if d.process_index < 3])
res = {}
if pid < 3:
    params = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    pub = TransferPublisher(cluster, cfg, t_mesh, (1, 1), "float32", num_actors=1, verify=True)
    # As the trainer processes of a run: publish the first version, then a collective over all three
    # (verify=True: `publish` itself ends in one, the checksum).
    msg = pub.publish(0, params)
    res = dict(processes=pub.plan.processes, slots=pub.writer is not None, checksum=msg.checksum,
               after=checksum(params))
else:
    s_mesh = make_mesh((1, 1), ("data", "tensor"), jax.local_devices())
    recv = TransferReceiver(cluster, 0, cfg, t_mesh, s_mesh, "float32")
    got = recv.receive(NewWeights(0))
    want = init_params(cfg, jax.random.key(0), s_mesh, SAMPLER_RULES)
    res = dict(equal=all(np.array_equal(np.asarray(a), np.asarray(b))
                         for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))),
               shm=sorted(recv.readers), transfer=sorted(recv.conns))
json.dump(res, open(f"{out}.{pid}", "w"))
cluster.barrier("end")
"""


def test_trainer_processes_that_offer_no_piece_do_not_wait_for_receivers(tmp_path):
    """A (3, 1) trainer mesh over three processes whose leaves no axis divides: process 0 cuts every piece,
    processes 1 and 2 offer none, and no receiver says how it would take theirs. They must not wait for
    that: they publish at once and meet process 0 in the next collective (which gives up after 30 s)."""
    out = str(tmp_path / "proc")
    codes = _run_processes(IDLE_TRAINERS, 4, out, timeout=120)
    assert codes == [0, 0, 0, 0]
    res = [json.load(open(f"{out}.{pid}")) for pid in range(4)]
    assert [r["processes"] for r in res[:3]] == [[0]] * 3
    assert [r["slots"] for r in res[:3]] == [True, False, False]  # shared memory only where pieces are
    assert len({r["checksum"] for r in res[:3]}) == 1 and res[0]["checksum"] == res[0]["after"]
    assert res[3] == {"equal": True, "shm": [0], "transfer": []}


LORA = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
pid, port, out, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax._src.distributed import global_state
from jaxrl_async.model import abstract_params, init_params, lora as lora_lib, presets
from jaxrl_async.runtime.cluster import Cluster, Roles
from jaxrl_async.runtime.lora_sync import LoraPublisher, LoraReceiver, WeightsMismatch
from jaxrl_async.runtime.messages import NewWeights
from jaxrl_async.sharding import TRAINER_RULES, make_mesh, tree_shardings

cluster = Cluster(Roles(2, (1,), (0,)), pid, global_state.client)
cfg = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
lora = lora_lib.LoraConfig(enabled=True, rank=4, init="normal")
t_mesh = make_mesh((1, 1), ("fsdp", "tensor"), [d for d in jax.devices() if d.process_index == 0])
s_mesh = make_mesh((1, 1), ("data", "tensor"), [d for d in jax.devices() if d.process_index == 1])
res = {}
if pid == 0:
    base = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    sh = tree_shardings(lora_lib.adapter_specs(cfg, lora), t_mesh, TRAINER_RULES)
    pub = LoraPublisher(cluster, cfg, lora, t_mesh, (1, 1), 1, base, verify=True, transport=transport)
    pub.resolve_paths()
    for v in range(2):
        msg = pub.publish(v, lora_lib.init_adapters(cfg, lora, jax.random.key(v + 1), sh))
        res[f"base_held_{v}"] = bool(pub.base._offered.get(0))  # the base's cut pieces, kept for pulls
        cluster.publish(f"sent/{v}", repr(msg.checksum))
        cluster.barrier(f"got_{v}")
else:
    recv = LoraReceiver(cluster, 0, cfg, lora, t_mesh, s_mesh, verify=True, apply="merge",
                        transport=transport)
    sums = [float(cluster.lookup("sent/0"))]
    got = recv.receive(NewWeights(0, None, sums[0]))
    res["base_bytes"], res["bytes"] = recv.base_bytes, [recv.last_bytes]
    cluster.barrier("got_0")
    sums.append(float(cluster.lookup("sent/1")))
    try:  # version 1 with a checksum that is not what was sent
        recv.receive(NewWeights(1, None, sums[1] + 1.0))
    except WeightsMismatch as e:
        res["mismatch"] = str(e)
    res["bytes"].append(recv.last_bytes)
    cluster.barrier("got_1")
    res.update(checked={str(k): v for k, v in recv.checked.items()}, sums=sums,
               shm=sorted(recv.adapters.readers), base_shm=sorted(recv.base.readers),
               adapter_bytes=lora_lib.adapter_bytes(cfg, lora, cfg.dtype),
               model_bytes=sum(x.size * x.dtype.itemsize
                               for x in jax.tree.leaves(abstract_params(cfg.compute_copy()))))
json.dump(res, open(f"{out}.{pid}", "w"))
cluster.barrier("end")
"""


@pytest.mark.parametrize("transport", ["auto", "transfer"])
def test_lora_moves_the_base_once_then_adapters_checked_against_the_sent_sum(tmp_path, transport):
    """LoraPublisher -> LoraReceiver between two processes of this host, over shared memory (the CPU
    default) and the transfer server: the base arrives once with the first version, each version brings
    exactly the adapters' bytes, the receiver's checksum of them equals the publisher's, a version whose
    sum differs is refused by name, and once the receiver holds the base the publisher lets go of the
    pieces it cut for it (over the transfer server, a copy of the base on the trainer's devices)."""
    out = str(tmp_path / "lora")
    codes = _run_processes(LORA, 2, out, transport, timeout=180)
    assert codes == [0, 0]
    pub, res = (json.load(open(f"{out}.{pid}")) for pid in (0, 1))
    assert (res["shm"], res["base_shm"]) == (([0], [0]) if transport == "auto" else ([], []))
    assert (pub["base_held_0"], pub["base_held_1"]) == (transport == "transfer", False)
    assert res["base_bytes"] == res["model_bytes"] and res["bytes"] == [res["adapter_bytes"]] * 2
    assert res["adapter_bytes"] < res["model_bytes"] / 10
    assert list(res["checked"]) == ["0"] and res["checked"]["0"] == pytest.approx(res["sums"][0], rel=1e-6)
    assert res["mismatch"].startswith("version 1: received adapters sum to")
