"""The asynchronous loop end to end on tiny shapes: trains, syncs weights, respects eta, writes the tags."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny_arith
from jaxrl_async.checkpoint import load_policy
from jaxrl_async.metrics import SCALAR_TAGS, read_scalars
from jaxrl_async.orchestrator import Orchestrator
from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.setup import build_setup
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUIRED_TAGS = SCALAR_TAGS  # the tags the README documents


def _small(workdir, **overrides):
    c = tiny_arith.get_config()
    c.workdir = str(workdir)
    c.total_steps = 4
    c.prompts_per_step = 4
    c.samples_per_prompt = 4
    c.eval_every = 2
    c.eval_prompts = 16
    c.max_staleness = 1
    c.mesh.sampler = (2, 1)
    c.mesh.trainer = (2, 1)
    c.sampler.num_slots = 8
    c.trainer.token_budget = 64
    c.trainer.rows_per_micro = 2
    c.warm_start.enabled = False
    # A random tiny model never solves addition; reward "contains a digit" (~50%) gives every group signal.
    c.data.reward = "format"
    c.reward.defaults = {"format_regex": "[0-9]"}
    for k, v in overrides.items():
        target = c
        *path, last = k.split(".")
        for p in path:
            target = target[p]
        target[last] = v
    return c


def test_config_errors_name_the_field(tmp_path):
    n = len(jax.devices())
    with pytest.raises(ConfigError, match=r"config\.trainer: .*lr"):
        validate(_small(tmp_path, **{"trainer.lr": -1.0}), n)
    with pytest.raises(ConfigError, match=r"config\.mode"):
        validate(_small(tmp_path, mode="fast"), n)
    with pytest.raises(ConfigError, match=r"config\.mesh.*need 24 devices"):
        validate(_small(tmp_path, **{"mesh.sampler": (4, 4), "mesh.trainer": (4, 2)}), n)
    with pytest.raises(ConfigError, match=r"config\.model\.n_layers"):
        validate(_small(tmp_path, **{"model.n_layers": -1}), n)
    with pytest.raises(ConfigError, match=r"config\.workdir"):
        validate(_small(""), n)
    with pytest.raises(ConfigError, match=r"config\.max_staleness"):
        validate(_small(tmp_path, max_staleness=0), n)
    with pytest.raises(ConfigError, match=r"config\.sampler\.attention"):
        validate(_small(tmp_path, **{"sampler.attention": "cpu_kernel"}), n)  # sampler mesh (2, 1)
    with pytest.raises(ConfigError, match=r"config\.sampler\.linear: 'cpu_kernel' runs on one CPU"):
        validate(_small(tmp_path, **{"sampler.linear": "cpu_kernel"}), n)
    one = {"mesh.sampler": (1, 1), "sampler.linear": "cpu_kernel", "model.dtype": "bfloat16"}
    with pytest.raises(ConfigError, match=r"config\.sampler\.linear: .*float32"):
        validate(_small(tmp_path, **one), n)
    with pytest.raises(ConfigError, match=r"config\.sampler: .*top_p"):
        validate(_small(tmp_path, **{"sampler.top_p": 1.5}), n)
    with pytest.raises(ConfigError, match=r"config\.trainer\.temperature"):
        build_setup(_small(tmp_path, **{"trainer.temperature": 0.5}))


def test_async_run_trains_syncs_respects_eta_and_writes_tags(tmp_path):
    setup = build_setup(_small(tmp_path))
    try:
        before = jax.tree.map(np.asarray, setup.state.params)
        summary = Orchestrator(setup).run()
        assert summary["steps"] == 4 and int(setup.state.version) == 4
        assert summary["max_admission_ahead"] <= 1
        assert summary["staleness_max"] >= 0 and summary["train_tokens_per_s"] > 0
        after = jax.tree.map(np.asarray, setup.state.params)
        changed = [
            not np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
        ]
        assert all(changed), "every parameter should move after 4 updates"
        synced = setup.engine_params()  # the sampler's copy after the last weight sync
        for a, b in zip(jax.tree.leaves(setup.state.params), jax.tree.leaves(synced), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert b.sharding.mesh.devices.flat[0] in setup.sampler_mesh.devices.flat
        assert setup.engine.version == 4
    finally:
        setup.close()
    scalars = read_scalars(os.path.join(tmp_path, "tb"))
    for tag in REQUIRED_TAGS:
        assert tag in scalars, tag
    assert [s for s, _ in scalars["loss/policy"]] == [1, 2, 3, 4]
    with open(os.path.join(tmp_path, "summary.json")) as f:
        assert json.load(f)["steps"] == 4

    # The trained policy loads from the run directory alone (model.json + the newest step's params) ...
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model_cfg, params, tokenizer, version = load_policy(str(tmp_path), mesh, SAMPLER_RULES)
    assert (model_cfg, tokenizer, version) == (setup.model_cfg, "char", 4)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # ... also from a step directory; a missing version is named; the generate CLI samples from the run.
    assert load_policy(os.path.join(tmp_path, "checkpoints", "4"), mesh, SAMPLER_RULES)[3] == 4
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step 2 \(saved: \[4\]\)"):
        load_policy(str(tmp_path), mesh, SAMPLER_RULES, step=2)
    cmd = [sys.executable, os.path.join(REPO, "tools", "generate.py"), "--checkpoint", str(tmp_path)]
    cmd += ["--prompt", "12+34=", "--max-new-tokens", "4", "--cpu-kernels"]
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    assert "policy version 4" in res.stdout
    assert len([line for line in res.stdout.splitlines() if line.startswith("ids:")]) == 1

    # Resume: a longer run in the same workdir continues from version 4 with the saved data position.
    setup = build_setup(_small(tmp_path, total_steps=5))
    try:
        orch = Orchestrator(setup)
        assert orch.version == 4
        assert orch.run()["steps"] == 5
    finally:
        setup.close()


def test_sync_mode_is_eta_zero(tmp_path):
    setup = build_setup(_small(tmp_path, mode="sync", total_steps=2, eval_every=0))
    try:
        summary = Orchestrator(setup).run()
    finally:
        setup.close()
    assert summary["max_staleness"] == 0 and summary["max_admission_ahead"] == 0
    assert summary["staleness_max"] == 0  # every sample was produced by the policy it trains


def test_colocated_roles_share_devices(tmp_path):
    n = len(jax.devices())
    with pytest.raises(ConfigError, match=r"config\.mesh.*colocated.*need 16 devices"):
        big = {"mesh.sampler": (4, 4), "mesh.trainer": (2, 1), "mesh.colocate": True}
        validate(_small(tmp_path, **big), n)
    cfg = _small(tmp_path, mode="sync", total_steps=2, eval_every=0, **{"mesh.colocate": True})
    setup = build_setup(cfg)
    try:
        assert list(setup.sampler_mesh.devices.flat) == list(setup.trainer_mesh.devices.flat)
        assert Orchestrator(setup).run()["steps"] == 2
    finally:
        setup.close()
