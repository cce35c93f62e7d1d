"""Multi-controller runs on localhost: separate sampler and trainer processes (jax.distributed, gloo)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxrl_async.model import ModelConfig, abstract_params
from jaxrl_async.run_config import MeshConfig
from jaxrl_async.runtime.cluster import ClusterError, Flags, Roles
from jaxrl_async.runtime.metrics import read_scalars
from tests.claims import (
    assert_each_prompt_trained_once,
    assert_staleness_bound,
    final_coordinator_state,
    read_ledger,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "local_cluster.py")

# The small run of test_orchestrator as a config file (a random model never solves addition: the reward
# "contains a digit" gives every group signal).
SMALL = """
import os

from configs import tiny_arith


def get_config():
    c = tiny_arith.get_config()
    # The suite's compile cache (tests/conftest.py): every process loads what an earlier test compiled.
    c.compile_cache_dir = os.environ.get("JAXRL_TESTS_COMPILE_CACHE_DIR", "")
    c.total_steps, c.prompts_per_step, c.samples_per_prompt = 4, 4, 4
    c.eval_every, c.eval_prompts, c.max_staleness = 2, 16, 1
    c.sampler.num_slots = 8
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, 2
    c.warm_start.enabled = False
    c.reward.reward = "format"
    c.reward.defaults = {"format_regex": "[0-9]"}
    c.verify_weights = True
    c.checkpoint_every = 1
    return c
"""


def _flags(workdir, **overrides) -> list[str]:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "small_config.py")
    with open(path, "w") as f:
        f.write(SMALL)
    return [f"--config={path}", f"--config.workdir={workdir}"] + [
        f"--config.{k}={v}" for k, v in overrides.items()
    ]


def _launch(n: int, devices: int, flags: list[str], timeout: float = 600, **popen):
    cmd = [sys.executable, LAUNCHER, "--num-processes", str(n), "--devices-per-process", str(devices)]
    cmd += ["--heartbeat-timeout-s", "10", "--", *flags]
    env = dict(os.environ, PYTHONPATH=REPO)
    if popen:
        return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # Its own session, so that a cluster past `timeout` ends whole (the launcher and its processes, which a
    # kill of the launcher alone would leave running beside the rest of the suite), and its output, with
    # the runs' "no progress" reports, says where it stood.
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = (out + err)[-8000:]
        raise AssertionError(f"the cluster ran past {timeout:.0f} s; its output ends:\n{tail}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _checksums_equal(summary) -> None:
    _checksums_equal_from(summary, 0)


def _checksums_equal_from(summary, start: int) -> None:
    sums = summary["weight_checksums"]
    learner = {int(k): v for k, v in sums["learner"].items()}
    assert sorted(learner) == list(range(start, summary["steps"] + 1))
    for actor in sums["actors"].values():
        got = {int(k): v for k, v in actor.items()}
        assert sorted(got) == sorted(learner)
        for v in learner:
            assert got[v] == pytest.approx(learner[v], rel=1e-6), f"version {v}"


def _beside_one_process(launch, flags: list[str], workdir):
    """Runs the one-process reference run (`launch/run.py` with `flags`) while `launch()` runs the cluster:
    the two are independent runs in workdirs of their own, and each is mostly one compile thread or
    waiting on a peer, so side by side they take little more than the longer one. Returns (the cluster's
    result, the reference run's `CompletedProcess`)."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), *flags]
    with open(workdir / "run.out", "w+") as out, open(workdir / "run.err", "w+") as err:
        proc = subprocess.Popen(cmd, env=env, text=True, stdout=out, stderr=err)
        try:
            res = launch()
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0), err.seek(0)
        one = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    return res, one


def test_roles_and_flags_are_validated_before_anything_connects():
    mesh = lambda s, t: MeshConfig((1, 1), (1, 1), 1, sampler_processes=s, trainer_processes=t)
    assert Roles.from_config(mesh((), ()), 1) == Roles(1, (0,), (0,))
    roles = Roles.from_config(mesh((2,), (0, 1)), 3)
    assert roles.lead == 0 and roles.role(2) == "sampler 0" and roles.role(1) == "trainer"
    with pytest.raises(ClusterError, match=r"process\(es\) \[2\] are in neither"):
        Roles.from_config(mesh((1,), (0,)), 3)
    with pytest.raises(
        ClusterError, match=r"config\.mesh\.trainer_processes=\(1,\): must start with process 0"
    ):
        Roles.from_config(mesh((0,), (1,)), 2)
    with pytest.raises(ClusterError, match=r"share process"):
        Roles.from_config(mesh((0, 1), (0,)), 2)
    with pytest.raises(ClusterError, match=r"--num_processes=2: set config\.mesh\.devices_per_process"):
        Roles.from_config(mesh((), ()), 2)
    with pytest.raises(ClusterError, match=r"--coordinator_address='10\.0\.0\.1': expected HOST:PORT"):
        Flags.resolve(coordinator_address="10.0.0.1")
    with pytest.raises(ClusterError, match=r"--process_id=3: must be in \[0, --num_processes=2\)"):
        Flags.resolve(coordinator_address="h:1", num_processes=2, process_id=3)


def test_bad_process_layout_fails_fast_naming_the_flag(tmp_path):
    """Every process refuses the layout itself, before it connects: none reaches its role (the line
    "process i of 3: ..." follows the connection) and none has to be stopped by the launcher."""
    flags = _flags(tmp_path, **{"mesh.sampler_processes": "(1,)", "mesh.trainer_processes": "(0,)"})
    res = _launch(3, 1, flags, timeout=120)
    assert res.returncode != 0
    assert "process(es) [2] are in neither config.mesh.sampler_processes" in res.stdout
    assert not re.search(r"process \d of 3: ", res.stdout), res.stdout[-3000:]
    assert set(re.findall(r"\[launcher\] process (\d) exited with status 1", res.stdout)) == {"0", "1", "2"}
    assert "killed by" not in res.stdout


def test_sampler_and_trainer_processes_sync_weights_every_step(tmp_path):
    """2 processes x 2 CPU devices: the learner (and coordinator) on process 0, the sampler on process 1;
    no role lists: the roles follow from the meshes and each process's device count."""
    flags = _flags(tmp_path, **{"mesh.sampler": "(2,1)", "mesh.trainer": "(2,1)"})
    res = _launch(2, 2, flags)
    assert res.returncode == 0, res.stdout[-4000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["processes"] == 2 and summary["steps"] == 4
    assert summary["max_admission_ahead"] <= 1  # max_staleness holds
    _checksums_equal(summary)
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4]
    # Exactly one TensorBoard writer: one event file, written by the learner lead.
    events = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if "tfevents" in f]
    assert len(events) == 1 and os.path.dirname(events[0]) == str(tmp_path / "tb")
    assert [s for s, _ in read_scalars(str(tmp_path / "tb"))["loss/policy"]] == [1, 2, 3, 4]
    assert "process 1 of 2: sampler 0" in res.stdout and "process 0 of 2: learner lead" in res.stdout


def test_two_sampler_replicas_share_eta_get_every_version_and_only_actor_0_evaluates(tmp_path):
    """A trainer process and two sampler replicas (one process each): admission across both actors stays
    within eta (= 1) at every step, every version reaches both replicas (equal checksums), and only actor
    0 evaluates (one held-out result per evaluated version)."""
    layout = {"mesh.sampler_processes": "(1,2)", "mesh.trainer_processes": "(0,)"}
    flags = _flags(tmp_path, **{"mesh.sampler": "(1,1)", "mesh.trainer": "(1,1)"}, **layout)
    res = _launch(3, 1, flags)
    assert res.returncode == 0, res.stdout[-4000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["processes"] == 3 and summary["steps"] == 4
    assert sorted(summary["weight_checksums"]["actors"]) == ["0", "1"]
    _checksums_equal(summary)  # both replicas hold the trainer's weights after every version
    assert summary["max_admission_ahead"] <= 1 and summary["staleness_max"] <= 1
    scalars = read_scalars(str(tmp_path / "tb"))
    assert_staleness_bound(scalars, eta=1, steps=4)  # claim 9's check, across both actors
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4]
    assert "process 1 of 3: sampler 0" in res.stdout and "process 2 of 3: sampler 1" in res.stdout


def test_two_trainer_processes_match_one_process(tmp_path):
    """1 sampler + 2 trainer processes, sync mode, fixed seeds: the same losses as one process with the
    same trainer mesh shape."""
    common = {
        "mode": "sync",
        "total_steps": 3,
        "eval_every": 0,
        "mesh.trainer": "(2,1)",
        "mesh.sampler": "(1,1)",
    }
    multi = _flags(
        tmp_path / "multi", **common, **{"mesh.sampler_processes": "(2,)", "mesh.trainer_processes": "(0,1)"}
    )
    single = _flags(tmp_path / "single", **common)
    res, one = _beside_one_process(lambda: _launch(3, 1, multi), single, tmp_path / "single")
    assert res.returncode == 0, res.stdout[-4000:]
    assert one.returncode == 0, one.stderr[-4000:]
    losses = {
        k: [v for _, v in read_scalars(str(tmp_path / k / "tb"))["loss/policy"]] for k in ("multi", "single")
    }
    assert len(losses["multi"]) == 3
    assert losses["multi"] == pytest.approx(losses["single"], abs=1e-5)
    with open(tmp_path / "multi" / "summary.json") as f:
        summary = json.load(f)
    _checksums_equal(summary)  # the sampler assembled the two trainer processes' shards correctly


def test_trainer_mesh_over_three_processes_with_one_sampler(tmp_path):
    """3 trainer processes + 1 sampler: no dimension of the small model divides by 3, so process 0 cuts
    every piece of each version and processes 1 and 2 offer none; every trainer process still reaches the
    first train step's collective with the others (its rendezvous gives up after 30 s)."""
    overrides = {
        "total_steps": 2, "eval_every": 0, "eval_prompts": 4, "checkpoint_every": 0,
        "trainer.rows_per_micro": 3, "mesh.trainer": "(3,1)", "mesh.sampler": "(1,1)",
        "mesh.trainer_processes": "(0,1,2)", "mesh.sampler_processes": "(3,)",
    }  # fmt: skip
    flags = _flags(tmp_path, **overrides)
    res = _launch(4, 1, flags, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["processes"] == 4 and summary["steps"] == 2
    _checksums_equal(summary)
    assert "weights from trainer process 0 through shared memory" in res.stdout
    assert "from trainer process 1" not in res.stdout and "from trainer process 2" not in res.stdout
    assert 0.0 <= summary["sampler_idle_frac"] <= 1.0


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_ends_every_process(tmp_path, victim):
    """SIGKILL one process mid-run: the others exit non-zero, and the message says why (the dead peer, by
    name or through the heartbeat; the launcher's 10 s heartbeat timeout bounds the wait, and a 90 s limit
    only guards against a hang); the same cluster started again resumes from the last checkpoint, with
    the sampler's weights equal to the trainer's at every version and the ledger whole."""
    flags = _flags(
        tmp_path,
        **{"total_steps": 1000, "eval_every": 0, "mesh.sampler_processes": "(1,)"},
        **{"mesh.trainer_processes": "(0,)"},
    )
    proc = _launch(2, 1, flags, popen=True)
    pids, lines = {}, []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.match(r"\[launcher\] process (\d+).*: pid (\d+)", line)
            if m:
                pids[int(m.group(1))] = int(m.group(2))
            ckpt = tmp_path / "checkpoints"
            saved = ckpt.exists() and any(d.isdigit() for d in os.listdir(ckpt))
            if re.search(r"step \d+ \|", line) and saved:  # both roles run; a checkpoint is written
                break
        assert len(pids) == 2, "".join(lines)
        os.kill(pids[victim], signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out
    assert proc.returncode != 0
    assert f"[launcher] process {victim} was killed by SIGKILL" in text
    survivor = 1 - victim
    assert re.search(
        rf"\[launcher\] process {survivor} (exited with status [1-9]|was killed by SIGABRT)", text
    )
    if victim == 1:  # the survivor's error names the dead process (the hub's send or JAX's heartbeat)
        assert (
            "process 1 (actor:0) is unreachable" in text or "unhealthy (stopped sending heartbeats)" in text
        )
    again = _flags(tmp_path, **{"total_steps": 5, "eval_every": 0, "mesh.sampler_processes": "(1,)"},
                   **{"mesh.trainer_processes": "(0,)"})  # fmt: skip
    res = _launch(2, 1, again)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "resumed from" in res.stdout
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 5 and summary["evals"][0]["step"] >= 1  # from a checkpoint, not from 0
    _checksums_equal_from(summary, summary["evals"][0]["step"])
    # The ledger across the kill (claim 3; tests/claims.py, broken on purpose in test_claim_checks.py):
    # versions 1..5 without a gap, each trained on a full batch, no prompt trained twice (a version
    # retrained after the resume counts by its last line), and every prompt the coordinator started
    # trained or still in flight at the last checkpoint: none lost across the kill.
    state = final_coordinator_state(tmp_path)
    assert state["version"] == 5 and state["filtered"] == 0, state
    assert_each_prompt_trained_once(read_ledger(tmp_path), 5, 4, started=state["started"],
                                    in_flight=[key for _, key in state["in_flight"]])  # fmt: skip


def _start_running(tmp_path, flags, n=2, devices=1, timeout_s=300):
    """Launches the cluster and reads its output until a train step is logged and a checkpoint exists;
    returns (process, {process id: pid}, lines read)."""
    proc = _launch(n, devices, flags, popen=True)
    pids, lines = {}, []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.match(r"\[launcher\] process (\d+).*: pid (\d+)", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
        ckpt = tmp_path / "checkpoints"
        if re.search(r"step \d+ \|", line) and ckpt.exists() and any(d.isdigit() for d in os.listdir(ckpt)):
            break
    assert len(pids) == n, "".join(lines)
    return proc, pids, lines


def test_sigterm_on_the_sampler_process_saves_and_stops_the_run(tmp_path):
    """SIGTERM on a process that is not the lead (the sampler): it asks the learner lead to save after
    the step in flight and stop; every process then exits cleanly, and the checkpoint is the last step."""
    layout = {"mesh.sampler_processes": "(1,)", "mesh.trainer_processes": "(0,)"}
    flags = _flags(tmp_path, **{"total_steps": 1000, "eval_every": 0}, **layout)
    proc, pids, lines = _start_running(tmp_path, flags)
    try:
        os.kill(pids[1], signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out
    assert proc.returncode == 0, text[-4000:]
    assert "process 1 got SIGTERM: saving after the step in flight, then stopping" in text
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["preempted"] and 1 <= summary["steps"] < 1000
    saved = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    assert saved == summary["steps"]


def test_an_exception_in_the_sampler_process_stops_the_lead_with_its_reason(tmp_path):
    """A Python exception on process 1 (its reward service cannot import a module the config names): the
    lead stops too, and its error names process 1, its role and the exception."""
    layout = {"mesh.sampler_processes": "(1,)", "mesh.trainer_processes": "(0,)"}
    flags = _flags(tmp_path, **{"eval_every": 0, "reward.imports": "('no_such_module_q57',)"}, **layout)
    res = _launch(2, 1, flags, timeout=300)
    assert res.returncode != 0
    text = res.stdout
    lead = [line for line in text.splitlines() if line.startswith("[p0]")]
    assert any(re.search(r"process 1 \(sampler 0\) failed: .*ModuleNotFoundError.*no_such_module_q57", line)
               for line in lead), text[-4000:]  # fmt: skip


# ----- a sampler replica that spans processes --------------------------------------------------------

REPLICA = {"mesh.sampler": "(2,2)", "mesh.trainer": "(2,1)"}  # 3 processes x 2 devices: trainer, 2 members


def _texts(logdir) -> dict[int, list[str]]:
    """step -> the sorted sample texts the learner wrote (reward, prompt, completion)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[int, list[str]] = {}
    for e in acc.Tensors("samples/text_summary"):
        out.setdefault(e.step, []).append(make_ndarray(e.tensor_proto).item().decode())
    return {k: sorted(v) for k, v in out.items()}


def _members_agree(summary) -> dict:
    """The replica's leader and its member applied every version before the same decode step, decoded
    the same number of tokens and hold the learner's weights; returns the leader's record."""
    (rec,) = summary["replicas"].values()
    (member,) = rec["members"].values()
    assert member["process_id"] == 2
    assert member["applied_at"] == rec["applied_at"] and len(rec["applied_at"]) == summary["steps"] + 1
    assert member["tokens_generated"] == rec["tokens_generated"] > 0
    learner = summary["weight_checksums"]["learner"]
    assert sorted(map(int, member["checksums"])) == sorted(map(int, learner))
    for v, want in learner.items():
        assert member["checksums"][v] == pytest.approx(want, rel=1e-6), f"version {v}"
    return rec


def test_replica_over_two_processes_decodes_as_one_process(tmp_path):
    """One (2, 2) replica over processes 1 and 2 (2 CPU devices each) + a trainer process, sync, greedy:
    the same completions (token ids, as text) and losses as the same meshes in one process; the sampled
    logprobs equal the trainer's (is_weight = exp(trainer - sampler logprob) within 1e-5)."""
    common = {**REPLICA, "mode": "sync", "total_steps": 2, "eval_every": 0, "sampler.temperature": 0.0,
              "text_samples": 16}  # fmt: skip
    multi = _flags(tmp_path / "multi", **common)
    single = _flags(tmp_path / "single", **common, **{"mesh.fake_cpu_devices": 6})
    res, one = _beside_one_process(lambda: _launch(3, 2, multi), single, tmp_path / "single")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "process 2 of 3: sampler 0 member 1" in res.stdout
    assert one.returncode == 0, one.stderr[-4000:]
    texts = {k: _texts(tmp_path / k / "tb") for k in ("multi", "single")}
    assert sorted(texts["multi"]) == [1, 2] and all(len(t) == 16 for t in texts["multi"].values())
    assert texts["multi"] == texts["single"]
    scalars = {k: read_scalars(str(tmp_path / k / "tb")) for k in ("multi", "single")}
    loss = {k: [v for _, v in s["loss/policy"]] for k, s in scalars.items()}
    assert loss["multi"] == pytest.approx(loss["single"], abs=1e-5)
    assert all(abs(v - 1) <= 1e-5 for _, v in scalars["multi"]["is_weight/max"])
    with open(tmp_path / "multi" / "summary.json") as f:
        summary = json.load(f)
    _checksums_equal(summary)
    _members_agree(summary)


def test_replica_over_two_processes_applies_in_flight_updates_on_every_member(tmp_path):
    """Async, max_staleness = 1, recompute_kv: every version is applied on both members before the same decode
    step (some while sequences run), η holds, the weights equal the learner's on both; the first and
    the last version are evaluated (the member replays the evaluations' generate calls)."""
    flags = _flags(tmp_path, **REPLICA, **{"sampler.update_mode": "recompute_kv", "eval_every": 0})
    res = _launch(3, 2, flags)
    assert res.returncode == 0, res.stdout[-4000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 4 and summary["max_admission_ahead"] <= 1
    assert [e["step"] for e in summary["evals"]] == [0, 4]
    _checksums_equal(summary)
    rec = _members_agree(summary)
    assert any(step > 0 for step in rec["applied_at"].values())  # updates after decoding had started
    # Each process holds one data row of the mesh: one copy of the model split over its 2 devices. It
    # pulls exactly that (each block once, copied to its other holder), not the replica's two copies.
    with open(tmp_path / "checkpoints" / "model.json") as f:
        cfg = ModelConfig(**json.load(f)["model"])
    model_bytes = sum(math.prod(x.shape) * np.dtype(cfg.dtype).itemsize for x in jax.tree.leaves(
        abstract_params(cfg)))  # fmt: skip
    (member,) = rec["members"].values()
    assert rec["pulled_bytes"] == member["pulled_bytes"] == model_bytes


def test_a_killed_replica_member_ends_the_run(tmp_path):
    """SIGKILL the replica's non-leader member mid-run: every process exits non-zero (a 90 s limit only
    guards against a hang), and the leader's error names process 2 (the collective it waited in only
    names a socket), or JAX's heartbeat does when that collective hangs instead of failing."""
    flags = _flags(tmp_path, **REPLICA, **{"total_steps": 1000, "eval_every": 0, "checkpoint_every": 0})
    proc = _launch(3, 2, flags, popen=True)
    pids, lines = {}, []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.match(r"\[launcher\] process (\d+).*: pid (\d+)", line)
            if m:
                pids[int(m.group(1))] = int(m.group(2))
            if re.search(r"step 2 \|", line):  # the replica decodes and the weights flow
                break
        assert len(pids) == 3, "".join(lines)
        os.kill(pids[2], signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out
    assert proc.returncode != 0
    assert "[launcher] process 2 was killed by SIGKILL" in text
    for survivor in (0, 1):
        assert re.search(
            rf"\[launcher\] process {survivor} (exited with status [1-9]|was killed by SIGABRT)", text
        )
    # Ours when the collective fails on the broken socket; JAX's heartbeat (naming task 2) when it hangs.
    named = (r"process 2 \(sampler 0 member 1\) (stopped|failed)|process 2 \(member:2\) is unreachable"
             r"|stopped sending heartbeats\):\s*(\[p\d\] )?2\s")  # fmt: skip
    assert re.search(named, text), text[-4000:]


def test_lora_run_with_a_replica_over_two_processes_moves_the_base_once_then_only_adapters(tmp_path):
    """config.trainer.lora with a trainer process and one (1, 4) sampler replica over processes 1 and 2,
    over the transfer server (the path between hosts): the base reaches each member once; every version
    brings each member only its devices' blocks of the adapters (the receiver's count) and the learner
    logs the adapters' bytes; both members apply every version before the same decode step, and each
    one's checksum of the adapters it got equals the trainer's of what it sent."""
    from jaxrl_async.model import lora as lora_lib

    lora = lora_lib.LoraConfig(enabled=True, rank=4)
    # (1, 4): the tensor axis spans the two processes, so each member holds (and pulls) other blocks.
    flags = _flags(tmp_path, **{**REPLICA, "mesh.sampler": "(1,4)"},
                   **{"total_steps": 2, "eval_every": 0, "trainer.lora.enabled": True,
                      "trainer.lora.rank": lora.rank, "mesh.weight_transport": "transfer"})  # fmt: skip
    res = _launch(3, 2, flags)
    assert res.returncode == 0, res.stdout[-4000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2
    _checksums_equal(summary)  # the leader's sums are of the adapters it received (lora_sync._Apply)
    rec = _members_agree(summary)  # and the member's, checked against the sent sum (MemberReceive)
    with open(tmp_path / "checkpoints" / "model.json") as f:
        model_cfg = ModelConfig(**json.load(f)["model"])
    adapter_bytes = lora_lib.adapter_bytes(model_cfg, lora, model_cfg.dtype)  # from the shapes
    base = jax.tree.leaves(abstract_params(model_cfg.compute_copy()))  # the sampler's dtype
    model_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in base)
    got = summary["weight_bytes"]["actor:0"]
    assert model_bytes / 2 <= got["base"] < model_bytes  # once: its devices' blocks
    leader = got["versions"]
    assert sorted(leader) == ["0", "1", "2"] and len(set(leader.values())) == 1
    (member,) = rec["members"].values()
    # Each member pulls its own devices' blocks of the adapters (those split over tensor: half each; the
    # ones replicated: whole), never the whole set.
    assert rec["pulled_bytes"] == leader["2"] and member["pulled_bytes"] < adapter_bytes
    assert adapter_bytes / 2 <= rec["pulled_bytes"] < adapter_bytes
    assert rec["pulled_bytes"] + member["pulled_bytes"] >= adapter_bytes
    synced = read_scalars(str(tmp_path / "tb"))["perf/weight_sync_bytes"]
    assert synced == [(1, adapter_bytes), (2, adapter_bytes)] and adapter_bytes < model_bytes / 10
