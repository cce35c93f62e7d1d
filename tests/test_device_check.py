"""benchmarks/device_check.sh runs end to end on CPU in --smoke mode (tiny shapes, nothing downloaded), and
benchmarks/build_device_wheels.sh names exactly the packages the device check imports beyond the machine's."""

import json
import os
import re
import subprocess
import sys

from benchmarks.device_check_report import BARS, STAGES
from benchmarks.device_probe import PACKAGES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_smoke_runs_every_stage_and_writes_its_json(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # The script runs whatever Python it is given ($PYTHON), as the lent machine's own.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHON=sys.executable)
    out = tmp_path / "dc"
    proc = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--smoke", "--out", str(out), "--wheels", str(tmp_path / "-")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "device_check.json").read_text())
    assert list(res["stages"]) == list(STAGES) and all(s["rc"] == 0 for s in res["stages"].values())
    for name in ("env", "decode", "attention", "train_memory"):  # the probe's own stages mark completion
        assert res[name]["done"], name
    assert res["env"]["missing"] == {}
    points = [(p["batch"], p["context"]) for p in res["decode"]["points"]]
    assert points == [(1, 16), (1, 32)]
    assert all(p["tok_s"] > 0 and p["host_gap_s"] >= 0 for p in res["decode"]["points"])
    for layout in res["attention"]["layouts"].values():  # the run's attention vs blocked, same inputs
        assert layout["max_grad_diff"] < 1e-4 and abs(layout["loss"] - layout["loss_blocked"]) < 1e-3
    tm = res["train_memory"]
    # On CPU the plan check and this device compile the same programs: the figures agree exactly.
    assert tm["plan_check_peak_bytes"] == tm["compiled_here_peak_bytes"] > 0
    assert res["train_mfu"]["train_tokens_per_s"] > 0
    assert res["sync_1p5b"]["colocated"]["sync_GBps"] > 0 and res["sync_8b"]["colocated"]["sync_s"] > 0
    assert res["run"]["tags_missing"] == [] and res["run"]["last_step"] == 3
    assert set(res["bars"]) == set(BARS)
    # Correctness checks: attention (forward and backward, padding included) and the run's steps.
    assert res["checks"] == {
        "attention_one_segment_agrees": True, "attention_packed_agrees": True, "run_steps_finite": True
    }  # fmt: skip


def test_the_wheel_list_covers_the_imports_the_lent_machine_lacks():
    with open(os.path.join(REPO, "benchmarks", "build_device_wheels.sh")) as f:
        script = f.read()
    pins = re.finditer(r"^\s+([A-Za-z0-9_.-]+)==", script, re.M)
    wheels = {m.group(1).lower().replace("-", "_") for m in pins}
    # What the lent machine lacks (its package list) and the module each one provides.
    lacking = {
        "ml_collections": "ml_collections",
        "grain": "grain",
        "array_record": "array_record",
        "tensorboardx": "tensorboardX",
        "math_verify": "math_verify",
        "pyzmq": "zmq",
        "latex2sympy2_extended": "latex2sympy2_extended",
        "antlr4_python3_runtime": "antlr4",
    }
    assert set(lacking) <= wheels
    assert set(lacking.values()) <= set(PACKAGES)  # the env stage imports each of them
