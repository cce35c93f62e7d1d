"""tools/device_check.sh runs end to end on CPU in --smoke mode (tiny shapes, nothing downloaded)."""

import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_smoke_writes_every_part(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = tmp_path / "dc"
    proc = subprocess.run(
        ["bash", "tools/device_check.sh", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "device_check.json").read_text())
    assert all(s["rc"] == 0 for s in res["stages"].values()) and len(res["stages"]) == 4
    batches = [p["batch"] for p in res["decode"]["latency"]]
    assert batches == [1, 8] and all(p["tok_s"] > 0 for p in res["decode"]["latency"])
    assert res["train"]["step_s"] > 0 and res["train"]["train_tokens_per_s"] > 0
    for layout in ("colocated", "two_meshes"):  # the smoke mode has 2 CPU devices
        assert res["weight_sync"][layout]["sync_GBps"] > 0
    assert res["run"]["tags_missing"] == [] and res["run"]["last_step"] == 3
    assert set(res["bars"]) == {"decode_b1_fraction_of_hbm", "train_mfu", "weight_sync_colocated_s"}
