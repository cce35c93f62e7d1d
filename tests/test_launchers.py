"""The cluster launchers: remote scripts print exactly what they would run (--dry-run); local core sets."""

import os
import stat
import subprocess
import sys

import pytest

from jaxrl_async.cli.local_cluster import child_env, core_blocks, parse_cpu_sets
from jaxrl_async.runtime.cluster import tpu_slice

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A new slice's workers read the model and the data from a bucket (the layout check leaves URLs to the run).
MATH_8B = ["--config.model.checkpoint=gs://b/models/Qwen3-8B", "--config.data.path=gs://b/data/math.jsonl"]


def _launch(script: str, *args: str, dry: bool = True, **env: str):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": REPO, **env}
    cmd = ["bash", os.path.join(REPO, "launch", script), *(["--dry-run"] if dry else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def _dry(script: str, *args: str, **env: str) -> str:
    res = _launch(script, *args, **env)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_tpu_pod_dry_run_creates_copies_runs_on_every_worker_and_tears_down():
    out = _dry("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/run 1", *MATH_8B, TPU_NAME="t1",
               SPOT="1")  # fmt: skip
    lines = [line for line in out.splitlines() if line.startswith("+ ")]
    assert [line.split()[5] if "tpu-vm" in line else line.split()[1] for line in lines] == [
        "create", "git", "scp", "scp", "ssh", "delete",
    ]  # fmt: skip
    # The default slice is the one math_8b's TPU layout is planned for: 64 chips on 16 hosts.
    assert "--accelerator-type=v5p-128" in lines[0] and "--spot" in lines[0] and " t1 " in lines[0]
    assert ".secret" in lines[3]  # the run's secret goes to every worker as a file ...
    ssh = lines[4]
    assert "JAXRL_SECRET_FILE=" in ssh and "JAXRL_SECRET=" not in ssh  # ... and only its path is on a command
    assert "--worker=all" in ssh and "launch/run.py" in ssh and "--config=configs/math_8b.py" in ssh
    assert "--num_processes=16" in ssh  # the host count the check derived
    remote = ssh.replace("\\ ", " ")  # printf %q escapes the remote command's spaces
    assert "python3.11 -m venv .venv" in remote  # the run gets its own environment, not the system pip
    assert ".venv/bin/python launch/run.py" in remote
    assert "--config.workdir=gs://b/run" in ssh  # the flag reaches the workers
    assert REPO not in ssh  # nothing of this machine's paths runs on the workers
    kept = _dry("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/r", *MATH_8B, KEEP="1",
                CREATE="0")  # fmt: skip
    assert "create" not in kept and "delete" not in kept


def test_tpu_pod_refuses_a_slice_the_layout_does_not_fit_before_any_gcloud_command():
    for dry in (True, False):  # gcloud is not installed here: a call would fail with 127, not 2
        res = _launch("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/r", *MATH_8B, dry=dry,
                      ACCELERATOR="v5p-32")  # fmt: skip
        assert res.returncode == 2, res.stderr
        assert "+ gcloud" not in res.stdout and "command not found" not in res.stderr
        assert "ACCELERATOR=v5p-32 (4 host(s) x 4 devices)" in res.stderr
        assert "config.mesh.sampler_replicas=12" in res.stderr and "nothing was created" in res.stderr
    bad = _launch("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/r", *MATH_8B,
                  ACCELERATOR="v9-8")  # fmt: skip
    assert bad.returncode == 2 and "unknown TPU accelerator type 'v9-8'" in bad.stderr


def test_tpu_pod_refuses_local_paths_on_a_new_slice_naming_the_field():
    """A new slice's workers start empty: a local model, data or workdir path is refused, in --dry-run and
    before `create`, naming the field; a missing field is blamed on the config, not on the slice."""
    local = ["--config.model.checkpoint=/data/Qwen3-8B", "--config.data.path=gs://b/data/math.jsonl"]
    for dry in (True, False):
        res = _launch("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/r", *local, dry=dry)
        assert res.returncode == 2 and "+ gcloud" not in res.stdout, res.stderr
        assert "config.model.checkpoint=/data/Qwen3-8B: a local path" in res.stderr
        assert "nothing was created" in res.stderr and "does not fit" not in res.stderr
    res = _launch("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=runs/m8b", *MATH_8B)
    assert res.returncode == 2 and "config.workdir=runs/m8b: a local path" in res.stderr
    # An existing slice (CREATE=0) may hold the files on its workers' disks: the path goes to the run.
    kept = _dry("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/r", *local, CREATE="0")
    assert "--config.model.checkpoint=/data/Qwen3-8B" in kept
    res = _launch("tpu_pod.sh", "configs/math_8b.py", *MATH_8B)  # no --config.workdir
    assert res.returncode == 2 and "config.workdir: required" in res.stderr
    assert "does not fit" not in res.stderr and "ACCELERATOR" not in res.stderr.split("config.workdir")[0]


def test_tpu_slice_types_count_cores_or_chips():
    assert tpu_slice("v5p-128") == (16, 4) and tpu_slice("v5p-8") == (1, 4) and tpu_slice("v4-32") == (4, 4)
    assert tpu_slice("v5litepod-8") == (1, 8) and tpu_slice("v5litepod-16") == (4, 4)
    assert tpu_slice("v6e-64") == (16, 4) and tpu_slice("v6e-4") == (1, 4)


def test_slurm_dry_run_starts_one_task_per_node_and_kills_all_on_failure():
    out = _dry("slurm_gpu.sbatch", "configs/math_8b.py:h100", "--config.workdir=/shared/r", *MATH_8B,
               SLURM_JOB_NUM_NODES="1", SLURM_GPUS_PER_NODE="h100:8")  # fmt: skip
    cmd = [line for line in out.splitlines() if line.startswith("+ ")]
    assert len(cmd) == 1
    assert cmd[0].startswith(f"+ srun --kill-on-bad-exit=1 --ntasks-per-node=1 {sys.executable} ")
    run = "launch/run.py --config=configs/math_8b.py:h100 --num_processes=1 --config.workdir=/shared/r"
    assert run in cmd[0]
    small = _launch("slurm_gpu.sbatch", "configs/math_8b.py:h100", "--config.workdir=/shared/r", *MATH_8B,
                    SLURM_JOB_NUM_NODES="1", SLURM_GPUS_PER_NODE="4")  # fmt: skip
    assert small.returncode == 2 and "+ srun" not in small.stdout
    assert "SLURM_JOB_NUM_NODES=1, GPUs per node=4" in small.stderr and "config.mesh" in small.stderr
    two = _launch("slurm_gpu.sbatch", "configs/math_8b.py:h100", "--config.workdir=/shared/r", *MATH_8B,
                  SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="8")  # fmt: skip
    # Placeable (the trainer on node 0, the replica on node 1), and the check says what it wastes.
    assert two.returncode == 0 and "--num_processes=2" in two.stdout
    assert "8 of 16 devices idle" in two.stderr


def test_local_cluster_gives_each_process_its_own_cores_and_devices():
    assert core_blocks(2, [0, 1]) == [[0], [1]]
    assert core_blocks(8, list(range(16))) == [[2 * i, 2 * i + 1] for i in range(8)]
    assert core_blocks(3, [0, 1]) == [[0], [1], [0]]  # more processes than cores: shared round-robin
    env = child_env(2)
    assert env["XLA_FLAGS"].count("xla_force_host_platform_device_count") == 1
    assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")


def test_cpu_sets_name_each_process_cores_and_may_overlap():
    assert parse_cpu_sets("0,1:1", 2, [0, 1]) == [[0, 1], [1]]
    assert parse_cpu_sets("0-3:4-7", 2, list(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_cpu_sets("2,0-1", 1, [0, 1, 2]) == [[0, 1, 2]]
    for text, n, match in [("0:1", 3, "2 core lists for 3 processes"), ("0:5", 2, r"process 1: cores \[5\]"),
                           ("0:a", 2, "'a' is not a core"), ("0:", 2, "'' is not a core"),
                           ("1-0:1", 2, "range '1-0' is empty")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_cpu_sets(text, n, [0, 1])


def test_local_cluster_starts_each_process_on_its_cpu_set(tmp_path):
    """A stand-in interpreter (--python) prints the cores each process was started on."""
    cores = sorted(os.sched_getaffinity(0))
    first, last = cores[0], cores[-1]
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -c "import os, sys; '
                    f'print(sys.argv[-1], sorted(os.sched_getaffinity(0)))" "$@"\n')  # fmt: skip
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)

    def launch(*flags: str):
        cmd = [sys.executable, os.path.join(REPO, "launch", "local_cluster.py"), "--num-processes", "2",
               f"--python={fake}", *flags, "--", "--config=unused"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": REPO}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)

    res = launch(f"--cpu-sets={first},{last}:{last}")
    assert res.returncode == 0, res.stderr
    # The last flag the launcher adds is --heartbeat_timeout_s; what follows it is the process's cores.
    assert f"[p0] --heartbeat_timeout_s=10 {sorted({first, last})}" in res.stdout
    assert f"[p1] --heartbeat_timeout_s=10 [{last}]" in res.stdout
    assert f"process 1 on cores [{last}]" in res.stdout
    three = f"{first}:{first}:{first}"
    bad = launch(f"--cpu-sets={three}")
    assert bad.returncode != 0 and f"--cpu-sets={three}: 3 core lists for 2 processes" in bad.stderr
    both = launch(f"--cpu-sets={first}:{first}", "--pin-cores")
    assert both.returncode != 0 and "--cpu-sets names every process's cores: drop --pin-cores" in both.stderr
