"""The asynchronous loop end to end on tiny shapes: trains, syncs weights, respects η, writes the tags."""

import json
import os
import re
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs import tiny_arith
from jaxrl_async.model import forward_logits, init_params, load_hf
from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime.checkpoint import load_policy
from jaxrl_async.runtime.metrics import SCALAR_TAGS, read_scalars
from jaxrl_async.runtime.orchestrator import run_from_config
from jaxrl_async.runtime.weight_sync import checksum
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh
from jaxrl_async.tokenizer import CharTokenizer
from tests.claims import assert_staleness_bound
from tests.procs import started

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUIRED_TAGS = SCALAR_TAGS  # the tags docs/configuration.md documents (tests/test_docs.py)


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
    c.reward.reward = "format"
    c.reward.defaults = {"format_regex": "[0-9]"}
    c.update_from_flattened_dict(overrides)  # "section.field" keys, type-checked as a flag would be
    return c


def test_config_errors_name_the_field(tmp_path):
    n = len(jax.devices())
    with pytest.raises(ConfigError, match=r"config\.eval_weights: 'copy' not in \('own', 'shared'\)"):
        validate(_small(tmp_path, eval_weights="copy"), n)
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
    with pytest.raises(ConfigError, match=r"config\.trainer\.temperature: derived from config\.sampler"):
        validate(ml_collections.ConfigDict({**_small(tmp_path).to_dict(),
                                            "trainer": {"temperature": 0.5}}), n)  # fmt: skip
    with pytest.raises(ConfigError, match=r"config\.mesh\.sampler_processes"):
        validate(_small(tmp_path, **{"mesh.sampler_processes": (-1,)}), n)
    with pytest.raises(ConfigError, match=r"config\.trainer\.token_budget=8: a packed row must hold"):
        validate(_small(tmp_path, **{"trainer.token_budget": 8}), n)
    with pytest.raises(ConfigError, match=r"config\.length_caps"):
        validate(_small(tmp_path, length_caps="lognormal:median=24"), n)


def test_knobs_that_must_agree_are_derived(tmp_path):
    n = len(jax.devices())
    run = validate(_small(tmp_path, **{"sampler.temperature": 0.7}), n)
    assert run.trainer.temperature == 0.7  # the trainer's logprobs use the sampler's temperature
    assert run.trainer.total_steps == 1000  # tiny_arith's schedule, set on purpose
    run = validate(_small(tmp_path, **{"trainer.total_steps": 0, "trainer.warmup_steps": 1}), n)
    assert run.trainer.total_steps == run.schedule.total_steps == 4  # trainer.total_steps = 0: the run length
    assert validate(_small(tmp_path, **{"sampler.temperature": 0.0}), n).trainer.temperature == 1.0
    assert "temperature" not in _small(tmp_path).trainer  # not a knob of its own
    # The reward: "" = the data task's; a name set in config.reward.reward is the run's.
    assert validate(_small(tmp_path, **{"reward.reward": ""}), n).reward.reward == "arithmetic"
    assert run.reward.reward == "format"


def test_async_run_trains_syncs_respects_eta_and_writes_tags(tmp_path):
    summary = run_from_config(_small(tmp_path, verify_weights=True))
    assert summary["steps"] == 4 and summary["processes"] == 1
    assert summary["max_admission_ahead"] <= 1 and summary["train_tokens_per_s"] > 0
    # After every sync the sampler held the trainer's weights: one checksum per version, equal.
    sums = summary["weight_checksums"]
    assert sorted(sums["learner"]) == [0, 1, 2, 3, 4]
    assert sums["actors"][0] == sums["learner"]
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4]
    # Evaluations ran beside sampling: the sampling engine kept decoding while one was in progress (how
    # many train steps overlap an evaluation depends on wall time, so it is reported, not asserted).
    assert [v for v, _, _ in summary["eval_spans"]] == [0, 2, 4]
    assert summary["sample_calls_during_eval"] >= 1
    assert set(summary["trainer_during_eval"]) >= {"versions_trained", "trainer_idle_frac"}
    scalars = read_scalars(os.path.join(tmp_path, "tb"))
    for tag in REQUIRED_TAGS:
        assert tag in scalars, tag
    assert [s for s, _ in scalars["loss/policy"]] == [1, 2, 3, 4]
    # The staleness bound the config guarantees (eta = max_staleness = 1), at every step: no sample
    # started more than eta versions before the policy it trains, and no token came from an older policy
    # than its sample's first (tokens decoded after an in-flight update are newer, never older).
    # (Claim 9: tests/claims.py, shown to fail on rollouts that break the bound in test_claim_checks.py.)
    assert summary["max_staleness"] == 1 and summary["staleness_max"] <= 1
    assert_staleness_bound(scalars, eta=1, steps=4)
    with open(os.path.join(tmp_path, "summary.json")) as f:
        assert json.load(f)["steps"] == 4

    # The trained policy loads from the run directory alone (model.json + the newest step's params): it
    # is the version the sampler last received, and every parameter moved from its initial value.
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model_cfg, params, tokenizer, version = load_policy(str(tmp_path), mesh, SAMPLER_RULES)
    assert (tokenizer, version) == ("char", 4)
    assert checksum(params) == pytest.approx(sums["learner"][4], rel=1e-6)
    before = init_params(model_cfg, jax.random.key(0), mesh, SAMPLER_RULES)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True):
        assert not np.array_equal(np.asarray(a), np.asarray(b)), "every parameter should move"
    # ... also from a step directory; a missing version is named; the generate CLI samples from the run.
    assert load_policy(os.path.join(tmp_path, "checkpoints", "4"), mesh, SAMPLER_RULES)[3] == 4
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step 2 \(saved: \[4\]\)"):
        load_policy(str(tmp_path), mesh, SAMPLER_RULES, step=2)
    cmd = [sys.executable, "-m", "jaxrl_async.cli.generate", "--checkpoint", str(tmp_path)]
    cmd += ["--prompt", "12+34=", "--max-new-tokens", "4", "--cpu-kernels"]
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    # ... and export to Hugging Face, side by side with the generate command (both only read the run).
    out = str(tmp_path / "hf")
    export = [sys.executable, "-m", "jaxrl_async.cli.export_hf", str(tmp_path), "--out", out]
    with started(cmd, env) as res, started(export, env) as exported:
        pass
    assert res.returncode == 0, res.stderr
    assert "policy version 4" in res.stdout
    assert len([line for line in res.stdout.splitlines() if line.startswith("ids:")]) == 1

    # The export: transformers loads it and gives our logits.
    res = exported
    assert res.returncode == 0 and "policy version 4" in res.stdout, res.stderr
    import torch
    import transformers

    assert "tokenizer: the character vocabulary" in res.stdout  # the run used the built-in char tokenizer
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("12+34=", add_special_tokens=False)["input_ids"] == CharTokenizer().encode("12+34=")
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, size=(2, 9)).astype(np.int32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    ours = np.asarray(forward_logits(model_cfg, jax.device_get(params), tokens))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)

    # Resume: a longer run in the same workdir continues from version 4 with the saved data position.
    resumed = run_from_config(_small(tmp_path, total_steps=5, verify_weights=True))
    # Its summary covers the whole run: the first process's evaluations before 4, then its own from 4.
    assert resumed["steps"] == 5 and resumed["resumed_at"] == [4]
    assert [e["step"] for e in resumed["evals"]][:3] == [0, 2, 4]
    assert resumed["weight_checksums"]["learner"][4] == pytest.approx(sums["learner"][4], rel=1e-6)


def test_dynamic_sampling_trains_informative_groups_only_within_max_staleness_and_kl_works(tmp_path):
    # Two samples per prompt with a ~50% reward: about half the groups have equal rewards. Dynamic
    # sampling discards them and admits new prompts in their place; every trained group is informative
    # and max_staleness still bounds staleness. The KL to the reference (the initial policy) is 0 at the first
    # step and grows as the policy moves.
    over = {"samples_per_prompt": 2, "trainer.dynamic_sampling": True, "trainer.kl_coef": 0.05,
            "trainer.skip_zero_advantage": False}
    summary = run_from_config(_small(tmp_path, eval_every=0, **over))
    assert summary["steps"] == 4 and summary["filtered_groups"] > 0
    assert summary["prompts_filtered"] == summary["filtered_groups"]
    assert summary["max_admission_ahead"] <= 1 and summary["staleness_max"] <= 1
    scalars = read_scalars(os.path.join(tmp_path, "tb"))
    assert [v for _, v in scalars["train/uninformative_group_frac"]] == [0.0] * 4
    assert min(v for _, v in scalars["dynamic_sampling/yield"]) < 1.0
    kl = dict(scalars["train/kl_ref"])
    assert kl[1] == pytest.approx(0.0, abs=1e-6) and kl[4] > 1e-6


def test_finish_update_mode_keeps_every_sample_on_one_version(tmp_path):
    """sampler.update_mode="finish" in a run: a new version waits until the running sequences end, so no
    sample's tokens span two versions (staleness/mixed_frac 0 at every step; with "finish" run as keep_kv
    this config measured 0.5 at step 3, 2026-12-05), while samples still start on an older version than
    the one they train (head staleness 1): the updates did arrive while sequences ran."""
    finish = {"sampler.update_mode": "finish"}
    summary = run_from_config(_small(tmp_path, total_steps=3, eval_every=0, **finish))
    assert summary["steps"] == 3
    scalars = read_scalars(os.path.join(tmp_path, "tb"))
    assert [v for _, v in scalars["staleness/mixed_frac"]] == [0.0] * 3
    assert [v for _, v in scalars["staleness/max"]][1:] == [1.0, 1.0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_non_finite_steps_are_sampled_again_and_stop_the_run_saved(tmp_path, mode, caplog):
    """A learning rate of 1e30 makes the weights overflow after the first update; every later step's
    updates are non-finite and skipped. Such a step changes no version, so its groups must go back to be
    sampled again (admission waits on the version: before, the run stalled for good once η's window was
    full), and three in a row end the run at the last finite version, saved."""
    over = {"trainer.lr": 1e30, "trainer.warmup_steps": 0, "trainer.clip_norm": None}
    summary = run_from_config(_small(tmp_path, mode=mode, total_steps=8, eval_every=0, **over))
    assert summary["stopped_non_finite"] and summary["non_finite_steps"] == 3
    assert 1 <= summary["steps"] < 8
    assert summary["prompts_started_again"] >= 2 * 4  # the first two skipped batches were started again
    # Each skipped step's warning says which was non-finite: the loss, the gradient norm, or both.
    skipped = re.findall(r"skipped \(loss (\S+), gradient norm (\S+)\)", caplog.text)
    assert len(skipped) == 3 and all("nan" in (lo + gn).lower() or "inf" in (lo + gn) for lo, gn in skipped)
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    _, params, _, version = load_policy(str(tmp_path), mesh, SAMPLER_RULES)
    assert version == summary["steps"]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_sync_mode_is_eta_zero(tmp_path):
    summary = run_from_config(_small(tmp_path, mode="sync", total_steps=2, eval_every=0))
    assert summary["max_staleness"] == 0 and summary["max_admission_ahead"] == 0
    assert summary["staleness_max"] == 0  # every sample was produced by the policy it trains


def test_colocated_roles_share_devices(tmp_path):
    n = len(jax.devices())
    with pytest.raises(ConfigError, match=r"config\.mesh.*colocated.*need 16 devices"):
        big = {"mesh.sampler": (4, 4), "mesh.trainer": (2, 1), "mesh.colocate": True}
        validate(_small(tmp_path, **big), n)
    cfg = _small(
        tmp_path, mode="sync", total_steps=2, eval_every=0, verify_weights=True, **{"mesh.colocate": True}
    )
    summary = run_from_config(cfg)
    assert summary["steps"] == 2
    assert summary["weight_checksums"]["actors"][0] == summary["weight_checksums"]["learner"]


def test_sampler_devices_hold_two_copies_of_the_weights(tmp_path):
    """The sampler's engine and the eval engine hold one decode-layout copy each (an evaluation keeps the
    version it evaluates while sampling swaps in newer ones); nothing else stays behind."""
    import gc

    from jaxrl_async.runtime.build import build_local

    proc = build_local(_small(tmp_path, eval_prompts=4))
    try:
        actor = proc.actor
        # the first version arrives; actor 0 evaluates it
        while actor.version is None or not actor.eval_schedule.results:
            actor.poll()
            proc.coordinator.poll()
        gc.collect()
        devices = set(actor.engine.mesh.devices.flat)
        buffers = {
            (s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
            for a in jax.live_arrays()
            for s in a.addressable_shards
            if s.device in devices
        }
        state = sum(x.nbytes for x in jax.tree.leaves(actor.loop._state)) // len(devices)
        per_device = sum(buffers.values()) / len(devices)
        weights = actor.engine.weight_bytes_per_device()
        assert 2 * weights <= per_device - state < 2.5 * weights  # two copies (and small round outputs)
    finally:
        proc.close()


@pytest.mark.parametrize("eval_weights", ["own", "shared"])
def test_trainer_steps_while_an_evaluation_is_in_progress(tmp_path, eval_weights):
    """A long evaluation (32 held-out prompts through 2 greedy slots) does not stop the one-process loop:
    train versions finish between its start and its end, whether the eval engine holds its own weights
    or shares the sampler's (config.eval_weights). The test drives the roles as the event loop does, and
    lets each train step in flight finish before the next round: the order of train steps and eval calls
    is then fixed by the design (an evaluation advances one decode call a round), not by the host's speed.
    An evaluation that ran to its end inside one round would see no new version."""
    from jaxrl_async.runtime.build import build_local

    proc = build_local(_small(tmp_path, total_steps=3, eval_every=0, eval_prompts=32, eval_slots=2,
                              eval_weights=eval_weights))  # fmt: skip
    try:
        evals, learner = proc.actor.eval_schedule, proc.learner
        versions_during_eval, rounds = set(), 0
        while not evals.results:  # until the evaluation of version 0 ends
            rounds += 1
            assert rounds < 20_000, proc.actor.describe()
            for role in proc.roles:
                role.poll()
            if learner.inflight is not None:
                jax.block_until_ready(learner.inflight.metrics)
            if evals.running is not None and evals.running.version == 0:
                versions_during_eval.add(learner.version)
        assert evals.results[0][0] == 0 and evals.sample_calls_during >= 1
        assert max(versions_during_eval) > min(versions_during_eval), versions_during_eval
    finally:
        proc.close()


def test_warm_start_trains_once_then_loads_from_its_cache(tmp_path):
    """config.warm_start with a cache: the first run trains it and writes the cache; a second run of the
    same config (another workdir) loads it, trains nothing, and starts RL from the same weights. The first
    is a LoRA run: the warm start trains (and evaluates) the whole model before the adapters exist, and a
    full fine-tuning run shares its cache."""
    # The task's own reward (arithmetic): "format" would score the untrained model 1.0, and nothing trains.
    ws = {"warm_start.enabled": True, "warm_start.max_steps": 3, "warm_start.batch": 8,
          "warm_start.eval_every": 3, "warm_start.target_accuracy": 1.0,
          "warm_start.cache_dir": str(tmp_path / "cache"),
          "reward.reward": ""}  # fmt: skip
    lora = {"trainer.lora.enabled": True, "sampler.lora_apply": "unmerged"}
    runs = [
        run_from_config(_small(tmp_path / name, mode="sync", total_steps=1, eval_every=0, verify_weights=True,
                               **ws, **extra))  # fmt: skip
        for name, extra in (("first", lora), ("second", {}))
    ]
    first, second = (r["warm_start"] for r in runs)
    assert first["cached"] is False and first["steps"] == 3
    assert second["cached"] is True and second["steps"] == 0 and second["accuracy"] == first["accuracy"]
    (key,) = os.listdir(tmp_path / "cache")  # one warm start, one entry
    model_cfg, cached = load_hf(str(tmp_path / "cache" / key))
    # The second run started from the cached weights (version 0), which the warm start moved from the init
    # (the LoRA run's learner checksums are its adapters').
    start = runs[1]["weight_checksums"]["learner"][0]
    assert start == pytest.approx(checksum(cached), rel=1e-6)
    assert checksum(init_params(model_cfg, jax.random.key(0))) != pytest.approx(start, rel=1e-6)


def test_a_second_sigint_aborts_and_a_first_signal_asks_to_stop():
    """The run's signal handlers (installed in the main thread, as pytest runs tests): the first SIGTERM
    or SIGINT is recorded for the event loop (save after the step in flight, then stop); a second SIGTERM
    changes nothing; a SIGINT after either aborts at once (KeyboardInterrupt). raise_signal delivers to
    this thread before it returns (a kill of the process could land on one of JAX's threads later)."""
    import signal

    from jaxrl_async.runtime.orchestrator import _StopSignals

    before = signal.getsignal(signal.SIGINT)
    signals = _StopSignals()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before
    signals = _StopSignals()
    try:
        signal.raise_signal(signal.SIGINT)
        assert signals.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signals.restore()
