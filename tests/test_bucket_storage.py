"""A pod's storage: workdirs, checkpoints, model checkpoints and data in a bucket (gs://), served here by
a GCS emulator on localhost (the `bucket` fixture). Nothing may land in a local `gs:` folder."""

import json
import os
import subprocess
import sys
import uuid

import jax
import numpy as np
from etils import epath

from jaxrl_async import storage
from jaxrl_async.data import DataConfig
from jaxrl_async.data.sources import load_records
from jaxrl_async.model import load_hf, presets, save_hf
from jaxrl_async.model.params import init_params
from jaxrl_async.runtime.metrics import MetricsWriter, read_scalars
from jaxrl_async.runtime.schedule_log import read_schedule, schedule_path
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prefix(bucket) -> str:
    return f"{bucket.url}/{uuid.uuid4().hex[:8]}"


def _local_gs_folders(*roots) -> list[str]:
    """Every local folder named `gs:` under `roots` (what os.path makes of a gs:// path)."""
    return [os.path.join(d, n) for r in roots for d, dirs, _ in os.walk(r) for n in dirs if n == "gs:"]


def test_storage_helpers_on_a_bucket(bucket, tmp_path):
    root = _prefix(bucket)
    assert storage.is_url(root) and not storage.is_url(str(tmp_path))
    assert storage.resolve(root + "/") == root  # a URL is never made "absolute" against the cwd
    # The ledger: an object store cannot append, so each write rewrites the object; a reopened log
    # (a resumed run) continues after the lines already there.
    ledger = storage.join(root, "trained_uids.jsonl")
    log = storage.AppendLog(ledger)
    log.write('{"version": 1}')
    assert storage.read_text(ledger) == '{"version": 1}\n'
    log.close()
    log = storage.AppendLog(ledger)
    log.write('{"version": 2}')
    assert storage.read_text(ledger).splitlines() == ['{"version": 1}', '{"version": 2}']
    # TensorBoard: staged locally, copied on flush, readable from the bucket.
    w = MetricsWriter(root)
    w.scalars(1, {"reward/mean": 0.5})
    w.flush()
    w.scalars(2, {"reward/mean": 0.75})
    staging = w._staged.local
    w.close()
    assert not os.path.exists(staging)  # the staging folder goes with the writer
    local = tmp_path / "tb"
    local.mkdir()
    for f in epath.Path(root, "tb").iterdir():
        storage.copy_file(str(f), str(local / f.name))
    assert read_scalars(str(local))["reward/mean"] == [(1, 0.5), (2, 0.75)]
    assert _local_gs_folders(tmp_path, os.getcwd()) == []


def test_model_and_data_read_from_a_bucket(bucket, tmp_path):
    root = _prefix(bucket)
    cfg = presets.get("tiny", vocab_size=64)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    params = init_params(cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    save_hf(cfg, params, str(tmp_path / "hf"))
    for f in (tmp_path / "hf").iterdir():
        storage.copy_file(str(f), f"{root}/hf/{f.name}")
    cache = tmp_path / "cache"
    os.environ["JAXRL_ASYNC_CACHE"] = str(cache)
    try:
        loaded_cfg, loaded = load_hf(f"{root}/hf")
    finally:
        del os.environ["JAXRL_ASYNC_CACHE"]
    assert loaded_cfg.n_layers == cfg.n_layers
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(loaded)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(list(cache.iterdir())) == 1  # one host-local copy of the bucket's directory
    # A JSONL data file in the bucket gives the same records, uids included, as the same file on disk.
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "train.jsonl").write_text(text)
    storage.write_text(f"{root}/data/train.jsonl", text)
    dcfg = DataConfig(task="jsonl", path=f"{root}/data/train.jsonl")
    assert load_records(dcfg, dcfg.path) == load_records(dcfg, str(tmp_path / "train.jsonl"))
    assert _local_gs_folders(tmp_path, os.getcwd()) == []


CONFIG = """
from configs import tiny_arith


def get_config():
    c = tiny_arith.get_config()
    c.prompts_per_step, c.samples_per_prompt = 4, 4
    c.eval_every, c.eval_prompts, c.max_staleness = 0, 8, 1
    c.checkpoint_every = 1
    c.sampler.num_slots = 8
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, 2
    c.warm_start.enabled = False
    c.reward.reward = "format"
    c.reward.defaults = {"format_regex": "[0-9]"}
    return c
"""


def _run(cwd, workdir: str, steps: int) -> str:
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), f"--config={cwd / 'config.py'}",
           f"--config.workdir={workdir}", f"--config.total_steps={steps}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def test_a_run_with_a_bucket_workdir_writes_there_and_resumes_from_it(bucket, tmp_path):
    workdir = f"{_prefix(bucket)}/run"
    (tmp_path / "config.py").write_text(CONFIG)
    _run(tmp_path, workdir, 2)
    w = epath.Path(workdir)
    names = {p.name for p in w.iterdir()}
    assert {"checkpoints", "tb", "summary.json", "trained_uids.jsonl"} <= names, names
    assert json.loads((w / "summary.json").read_text())["steps"] == 2
    assert {p.name for p in (w / "checkpoints").iterdir()} >= {"1", "2", "model.json"}
    assert any("tfevents" in p.name for p in (w / "tb").iterdir())
    # The second invocation resumes from the bucket: the step count continues and the ledger grows.
    out = _run(tmp_path, workdir, 3)
    assert "resumed from" in out
    assert json.loads((w / "summary.json").read_text())["steps"] == 3
    versions = [json.loads(line)["version"] for line in (w / "trained_uids.jsonl").read_text().splitlines()]
    assert versions == [1, 2, 3]
    # The schedule record (an async run records by default) is in the bucket too, one segment per start.
    learner = read_schedule(schedule_path(workdir, "learner")).records
    assert [r.get("version") for r in learner if "start" in r] == [0, 2]
    assert [r["t"] for r in learner if "t" in r] == [1, 2, 3]
    assert not read_schedule(schedule_path(workdir, "actor:0")).truncated
    assert _local_gs_folders(tmp_path, REPO) == []
