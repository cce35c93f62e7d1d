"""The cluster launchers: remote scripts print exactly what they would run (--dry-run); local core blocks."""

import os
import subprocess

from jaxrl_async.cli.local_cluster import child_env, core_blocks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dry(script: str, *args: str, **env: str) -> str:
    res = subprocess.run(
        ["bash", os.path.join(REPO, "launch", script), "--dry-run", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_tpu_pod_dry_run_creates_copies_runs_on_every_worker_and_tears_down():
    out = _dry("tpu_pod.sh", "configs/math_8b.py", "--config.workdir=gs://b/run 1", TPU_NAME="t1", SPOT="1")
    lines = [line for line in out.splitlines() if line.startswith("+ ")]
    assert [line.split()[5] if "tpu-vm" in line else line.split()[1] for line in lines] == [
        "create", "git", "scp", "scp", "ssh", "delete",
    ]  # fmt: skip
    assert "--accelerator-type=v5p-64" in lines[0] and "--spot" in lines[0] and " t1 " in lines[0]
    assert ".secret" in lines[3]  # the run's secret goes to every worker as a file ...
    ssh = lines[4]
    assert "JAXRL_SECRET_FILE=" in ssh and "JAXRL_SECRET=" not in ssh  # ... and only its path is on a command
    assert "--worker=all" in ssh and "launch/run.py" in ssh and "--config=configs/math_8b.py" in ssh
    assert "--config.workdir=gs://b/run" in ssh  # the flag reaches the workers
    assert REPO not in ssh  # nothing of this machine's paths runs on the workers
    kept = _dry("tpu_pod.sh", "configs/math_8b.py", KEEP="1", CREATE="0")
    assert "create" not in kept and "delete" not in kept


def test_slurm_dry_run_starts_one_task_per_node_and_kills_all_on_failure():
    out = _dry("slurm_gpu.sbatch", "configs/math_8b.py:h100", "--config.workdir=/shared/r")
    cmd = [line for line in out.splitlines() if line.startswith("+ ")]
    assert len(cmd) == 1
    assert cmd[0].startswith("+ srun --kill-on-bad-exit=1 --ntasks-per-node=1 python ")
    assert "launch/run.py --config=configs/math_8b.py:h100 --config.workdir=/shared/r" in cmd[0]


def test_local_cluster_gives_each_process_its_own_cores_and_devices():
    assert core_blocks(2, [0, 1]) == [[0], [1]]
    assert core_blocks(8, list(range(16))) == [[2 * i, 2 * i + 1] for i in range(8)]
    assert core_blocks(3, [0, 1]) == [[0], [1], [0]]  # more processes than cores: shared round-robin
    env = child_env(2)
    assert env["XLA_FLAGS"].count("xla_force_host_platform_device_count") == 1
    assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")
