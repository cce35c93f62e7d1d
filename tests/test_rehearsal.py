"""The pod rehearsal: a config's process/role/mesh layout in miniature on localhost (launch/local_cluster.py
--rehearse), and the checks it makes."""

import json
import os
import subprocess
import sys

import pytest

from configs import math_8b
from jaxrl_async.cli.rehearsal import miniature, verify
from jaxrl_async.run_config import ConfigError, MeshConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_miniature_keeps_the_per_host_layout_and_shrinks_the_counts():
    tpu = miniature(MeshConfig(**math_8b.get_config().mesh.to_dict()))
    assert (tpu.num_processes, tpu.devices_per_process) == (2, 4)
    assert tpu.sampler == (1, 4) and tpu.trainer == (2, 2) and tpu.replicas == 1  # tensor axis kept
    assert "16 processes x 4 devices" in tpu.real
    two = miniature(MeshConfig(**math_8b.get_config().mesh.to_dict()), trainer_processes=2, replicas=3)
    assert (two.num_processes, two.trainer, two.replicas) == (5, (4, 2), 3)
    gpu = miniature(MeshConfig(**math_8b.get_config("h100").mesh.to_dict()))
    assert (gpu.num_processes, gpu.devices_per_process, gpu.trainer) == (1, 8, (2, 2))
    with pytest.raises(ConfigError, match=r"config\.mesh\.devices_per_process: a rehearsal"):
        miniature(MeshConfig((1, 1), (1, 1), 1, sampler_processes=(1,), trainer_processes=(0,)))
    with pytest.raises(ConfigError, match=r"config\.mesh\.trainer=\(2, 8\): its tensor axis 8"):
        miniature(MeshConfig((1, 4), (2, 8), 1, devices_per_process=4))


def test_the_checks_fail_on_a_run_that_broke_them(tmp_path):
    mini = miniature(MeshConfig((1, 2), (2, 1), 1, devices_per_process=2))
    summary = {
        "processes": 2, "steps": 2, "max_admission_ahead": 2,
        "weight_checksums": {"learner": {"0": 1.0, "1": 2.0, "2": 3.0},
                             "actors": {"0": {"0": 1.0, "1": 2.5}}},
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = verify(str(tmp_path), mini, max_staleness=1, mode="async")
    failed = [line for line in lines if line.startswith("FAILED")]
    # The checksums differ, max_staleness=1 is exceeded, no TensorBoard writer: three failures, named.
    assert [f.split(":")[1].split()[0] for f in failed] == ["actor", "max_staleness", "one"]


def test_both_math_8b_layouts_rehearse_on_localhost(tmp_path):
    """The TPU layout (16 hosts x 4 chips) as 2 processes x 4 CPU devices with the pod's storage: the model,
    the data and the workdir only in a bucket (a GCS emulator), each process in a root of its own; the
    learner lead is killed after step 1 of 3 and the job resumes from the bucket, each prompt trained once.
    The 8-GPU layout as one process of 8 with a local workdir. Every check passes."""
    pytest.importorskip("gcp_storage_emulator", reason="the 'test' extra's GCS emulator")
    procs = {}
    # The suite's compile cache (tests/conftest.py) as the runs' config.compile_cache_dir: a bucket
    # rehearsal's processes get no cache through the environment (each has a root of its own), so the
    # TPU layout's second start (after the kill) compiled every program of both processes again; with it,
    # that start loads them (process 0 from JAX's cache, the sampler process from its executable store).
    cache = os.environ.get("JAXRL_TESTS_COMPILE_CACHE_DIR", "")
    run_flags = ["--", f"--config.compile_cache_dir={cache}"] if cache else []
    # The two rehearsals at once (independent commands, workdirs and buckets; each mostly one compile
    # thread or waiting on its peer): ~75 s one after the other on the loaded 2-core machine.
    for spec, extra in (("configs/math_8b.py", ["--rehearse-kill-step", "1", "--rehearse-steps", "3"]),
                        ("configs/math_8b.py:h100", ["--rehearse-storage", "local"])):  # fmt: skip
        workdir = tmp_path / spec.replace("/", "_").replace(":", "_")
        cmd = [sys.executable, os.path.join(REPO, "launch", "local_cluster.py"), "--rehearse", spec,
               "--rehearse-steps", "2", "--rehearse-workdir", str(workdir), *extra, *run_flags]  # fmt: skip
        log = tmp_path / f"{workdir.name}.out"
        with open(log, "w") as f, open(tmp_path / f"{workdir.name}.err", "w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), text=True,
                                    stdout=f, stderr=err)  # fmt: skip
        procs[spec] = (proc, log)
    out = {}
    try:
        for spec, (proc, log) in procs.items():
            proc.wait(timeout=600)
            stdout = log.read_text()
            assert proc.returncode == 0, stdout[-4000:]
            assert f"[rehearsal] passed: {spec}" in stdout and "[rehearsal] FAILED" not in stdout
            assert "weight checksums equal the learner's after every sync" in stdout
            out[spec] = stdout
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tpu = out["configs/math_8b.py"]  # the roles came from the topology: no role lists in the config
    assert "process 0 of 2: learner lead" in tpu and "process 1 of 2: sampler 0" in tpu
    assert "rehearsed as 2 process(es) x 4 CPU devices: trainer (2, 2), 1 replica(s) of (1, 4)" in tpu
    # The pod's storage: nothing of the run on a local disk, a resume from the bucket, each prompt once.
    assert "[rehearsal] storage: gs://rehearsal" in tpu and "killed (SIGKILL)" in tpu
    assert "resumed from gs://rehearsal/run/checkpoints at version" in tpu
    assert "ok: the ledger: versions [1]..[3], 12 prompts trained, 0 of them twice" in tpu
    assert "ok: one TensorBoard writer" in tpu
    tpu_dir = tmp_path / "configs_math_8b.py"
    local = {p.name for p in tpu_dir.rglob("*")}
    assert not local & {"checkpoints", "summary.json", "trained_uids.jsonl", "tb", "gs:"}, sorted(local)
