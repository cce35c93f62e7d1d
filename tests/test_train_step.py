"""Train step: packed == unpacked, micro-batched == one batch, sharded == single device, skips, metrics."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import forward, init_params, presets, token_logprobs
from jaxrl_async.rollouts import Rollout
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import (
    TrainConfig,
    compute_advantages,
    compute_logprobs,
    create_train_state,
    learning_rate_schedule,
    loglinear_prox_logp,
    loss_and_grads,
    pack_rollouts,
    pad_rollouts,
    policy_loss,
    prepare_batch,
    train_step,
)

MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
BASE = TrainConfig(
    lr=1e-2,
    token_budget=48,
    rows_per_micro=8,
    clip_norm=1.0,
    weight_decay=0.01,
    behav_mode="truncate",
    staleness_bins=3,
    minibatches=1,
)


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


def make_rollouts(n=16, seed=0, version=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = int(rng.integers(1, 12)), int(rng.integers(1, 20))
        behav = -4.2 + 0.3 * rng.normal(size=c)
        out.append(
            sample(
                rng.integers(0, 64, p),
                rng.integers(0, 64, c),
                behav,
                [version] * c,
                float(rng.integers(0, 2)),
                i // 4,
            )
        )
    return out


def tree_close(a, b, rtol=2e-4, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def reference_loss_and_grads(cfg, params, rollouts):
    """One sequence a row, no segment ids, plain jax.grad: independent of packing and accumulation."""
    adv = compute_advantages(cfg.advantage, [r.reward for r in rollouts], [r.group_id for r in rollouts])
    a = pad_rollouts(rollouts, adv, rows_per_micro=len(rollouts)).micro_batch(0)
    t = a["tokens"].shape[1]
    pos = jnp.broadcast_to(jnp.arange(t), a["tokens"].shape)

    def f(p):
        logits = forward(MODEL, p, jnp.asarray(a["tokens"]), pos)
        logp, _ = token_logprobs(logits, jnp.asarray(a["targets"]))
        s, c, _ = policy_loss(
            cfg.loss,
            logp,
            jax.lax.stop_gradient(logp),
            a["behav_logp"],
            a["advantages"],
            a["loss_mask"],
            **cfg.loss_hparams(),
        )
        return s / c

    return jax.jit(jax.value_and_grad(f))(params)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            loss="decoupled_ppo",
            aggregation="seq_mean",
            behav_mode="truncate",
            behav_level="sequence",
            behav_cap=1.2,
        ),
        dict(
            loss="gspo",
            aggregation="constant",
            constant=20.0,
            behav_mode="mask",
            behav_cap=1.5,
            eps_high=0.01,
        ),
    ],
)
def test_packed_and_micro_batched_equal_unpacked(params, overrides):
    rollouts = make_rollouts()
    cfg = dataclasses.replace(BASE, **overrides)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, params, rollouts)
    for rows in (8, 2):  # one micro-batch of 8 rows / several micro-batches of two rows
        c = dataclasses.replace(cfg, rows_per_micro=rows)
        batch = prepare_batch(c, rollouts)
        assert (batch.num_micro == 1) == (rows == 8) and batch.shape == (rows, 48)
        loss, grads, metrics = loss_and_grads(create_train_state(c, MODEL, params), batch)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-4, abs=1e-6)
        tree_close(grads, ref_grads)
        assert float(metrics["tokens"]) == batch.num_loss_tokens


sample = Rollout.for_trainer  # the run's record, built as the trainer reads it

# The model-family flag QK-norm over all heads, with norm weights away from their all-ones init.
ALL_HEADS = MODEL.replace(qk_norm=True, qk_norm_all_heads=True)


@pytest.mark.parametrize("model", [MODEL, ALL_HEADS], ids=["base", "qk_norm_all_heads"])
def test_trainer_logprobs_of_packed_rows_match_single_sequences(params, model):
    if model is ALL_HEADS:
        params = init_params(model, jax.random.key(0))
        noise = lambda x, i: x * (1 + 0.3 * jax.random.normal(jax.random.key(i), x.shape))
        layers = dict(params["layers"], q_norm=noise(params["layers"]["q_norm"], 1))
        params = dict(params, layers=dict(layers, k_norm=noise(layers["k_norm"], 2)))
    rollouts = make_rollouts(6)
    state = create_train_state(dataclasses.replace(BASE, rows_per_micro=2), model, params)
    batch = pack_rollouts(rollouts, np.arange(6), state.cfg.token_budget, rows_per_micro=2)
    assert (batch.arrays["segment_ids"].max(axis=-1) > 1).any(), (
        "the test needs rows holding several sequences"
    )
    packed = compute_logprobs(state, batch)
    # Plain forward: one sequence a row at positions 0.. with right padding and no segment ids.
    plain = pad_rollouts(rollouts, np.arange(6), rows_per_micro=6).micro_batch(0)
    pos = jnp.broadcast_to(jnp.arange(plain["tokens"].shape[1]), plain["tokens"].shape)
    logp = jax.jit(lambda p, x, t: token_logprobs(forward(model, p, x, pos), t)[0])
    want = np.asarray(logp(params, jnp.asarray(plain["tokens"]), jnp.asarray(plain["targets"])))
    for i in range(6):  # the advantage field carries the sequence index
        got = packed[(batch.arrays["advantages"] == i) & (batch.arrays["loss_mask"] > 0)]
        np.testing.assert_allclose(got, want[i][plain["loss_mask"][i] > 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8, 1)])
def test_sharded_step_matches_single_device(params, mesh_shape):
    cfg = BASE
    batches = [prepare_batch(cfg, make_rollouts(seed=s)) for s in (1, 2)]
    single = create_train_state(cfg, MODEL, params)
    sharded = create_train_state(cfg, MODEL, params, mesh=make_mesh(mesh_shape, ("fsdp", "tensor")))
    emb = sharded.params["layers"]["q"]
    assert len(emb.sharding.device_set) == 8
    _, g1, _ = loss_and_grads(single, batches[0])
    _, g2, _ = loss_and_grads(sharded, batches[0])
    tree_close(g2, g1, rtol=1e-4, atol=1e-6)
    for b in batches:
        single, m1 = train_step(single, b)
        sharded, m2 = train_step(sharded, b)
        for k in ("loss", "grad_norm", "clip_frac", "is_weight_mean", "behav_dropped_frac", "entropy_mean"):
            assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-6), k
    # Adam's first steps move every weight by ~lr (1e-2) whatever the gradient's size, so rounding
    # differences in near-zero gradients can show up here at a few percent of lr.
    tree_close(sharded.params, single.params, rtol=1e-4, atol=5e-4)
    assert int(sharded.version) == int(single.version) == 2
    mu = sharded.opt_state[1][0].mu["layers"]["q"]
    assert mu.sharding.is_equivalent_to(emb.sharding, mu.ndim)


def test_nonfinite_update_is_skipped_and_counted(params):
    state = create_train_state(BASE, MODEL, params)
    before = jax.tree.map(np.asarray, state.params)
    bad = make_rollouts()
    bad[0] = dataclasses.replace(bad[0], reward=float("nan"))
    state, m = train_step(state, prepare_batch(BASE, bad))
    assert int(m["skipped"]) == 1 and int(state.skipped) == 1 and int(state.version) == 0
    tree_close(state.params, before, rtol=0, atol=0)
    state, m = train_step(state, prepare_batch(BASE, make_rollouts()))
    assert int(m["skipped"]) == 0 and int(state.version) == 1 and int(state.updates) == 1
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0


def test_staleness_histogram_and_version(params):
    cfg = BASE
    state = create_train_state(cfg, MODEL, params)
    state, _ = train_step(state, prepare_batch(cfg, make_rollouts(seed=3)))
    state, _ = train_step(state, prepare_batch(cfg, make_rollouts(seed=4)))
    assert int(state.version) == 2
    rollouts = make_rollouts(8, seed=5)
    versions = [2, 1, -7, 2, 0, 1, 2, 2]  # staleness 0, 1, 9, 0, 2, 1, 0, 0
    rollouts = [
        dataclasses.replace(r, versions=[v] * len(r.completion_tokens))
        for r, v in zip(rollouts, versions, strict=True)
    ]
    n = [len(r.completion_tokens) for r in rollouts]
    state, m = train_step(state, prepare_batch(cfg, rollouts))
    want = [n[0] + n[3] + n[6] + n[7], n[1] + n[5], n[2] + n[4]]  # the last bin holds staleness >= 2
    np.testing.assert_array_equal(np.asarray(m["staleness_hist"]), want)
    assert float(m["staleness_max"]) == 9
    assert float(m["staleness_mean"]) == pytest.approx((n[1] + n[5] + 9 * n[2] + 2 * n[4]) / sum(n))


def test_loglinear_prox_interpolates_by_version():
    behav, logp = jnp.full((1, 4), -2.0), jnp.full((1, 4), -1.0)
    got = loglinear_prox_logp(behav, logp, jnp.array([[3, 2, 0, 5]]), prox_version=3)
    # alpha = (3 - v) / (4 - v): 0, 1/2, 3/4; a token newer than the proximal policy clamps to 0
    np.testing.assert_allclose(got, [[-2.0, -1.5, -1.25, -2.0]], rtol=1e-6)


def test_loglinear_equals_recompute_for_fresh_on_policy_tokens(params):
    cfg = BASE
    rollouts = make_rollouts(8, seed=6)
    state = create_train_state(cfg, MODEL, params)
    logp = compute_logprobs(state, prepare_batch(cfg, rollouts))
    batch = prepare_batch(cfg, rollouts)
    batch.arrays["behav_logp"][...] = logp * batch.arrays["loss_mask"]  # on-policy behaviour logprobs
    out = {}
    for mode in ("recompute", "loglinear"):
        s = create_train_state(dataclasses.replace(cfg, prox_mode=mode), MODEL, params)
        out[mode] = loss_and_grads(s, batch)
    assert float(out["loglinear"][2]["is_weight_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(out["loglinear"][0]) == pytest.approx(float(out["recompute"][0]), rel=1e-5, abs=1e-7)
    tree_close(out["loglinear"][1], out["recompute"][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("minibatches", [2, 4])
def test_minibatches_mean_exactly_m_updates_per_step(params, minibatches):
    # One 8-row micro-batch holds all 16 sequences: the old split of micro-batches gave one update here.
    cfg = dataclasses.replace(BASE, minibatches=minibatches, prox_mode="recompute", warmup_steps=2,
                              total_steps=10)  # fmt: skip
    state = create_train_state(cfg, MODEL, params)
    steps, lrs = 2, []
    for seed in range(steps):
        batch = prepare_batch(cfg, make_rollouts(seed=seed))
        assert len(batch.updates) == minibatches
        state, m = train_step(state, batch)
        assert int(m["updates"]) == minibatches and int(m["skipped"]) == 0
        lrs.append(float(m["lr"]))
    assert int(state.updates) == minibatches * steps and int(state.version) == steps
    # The schedule counts train steps: the last update of step s runs at the rate of step s.
    sched = learning_rate_schedule(cfg)
    assert lrs == pytest.approx([float(sched(0)), float(sched(1))])


def test_minibatch_shares_are_disjoint_groups_and_the_step_loss_stays_exact(params):
    cfg = dataclasses.replace(BASE, rows_per_micro=2, minibatches=4)
    rollouts = make_rollouts()  # 4 groups of 4
    batch = prepare_batch(cfg, rollouts)
    assert batch.num_sequences == 16 and sum(batch.updates) == batch.num_micro
    whole = prepare_batch(BASE, rollouts)
    # Loss and gradient at the starting weights do not depend on how the batch is split.
    l4, g4, m4 = loss_and_grads(create_train_state(cfg, MODEL, params), batch)
    l1, g1, _ = loss_and_grads(create_train_state(BASE, MODEL, params), whole)
    assert float(l4) == pytest.approx(float(l1), rel=1e-5)
    tree_close(g4, g1)
    assert float(m4["tokens"]) == whole.num_loss_tokens


def test_a_batch_that_cannot_be_split_m_ways_names_the_field(params):
    cfg = dataclasses.replace(BASE, minibatches=5)
    with pytest.raises(ValueError, match="config.trainer.minibatches=5"):
        prepare_batch(cfg, make_rollouts())  # 4 groups
    state = create_train_state(dataclasses.replace(BASE, minibatches=2), MODEL, params)
    with pytest.raises(ValueError, match="config.trainer.minibatches=2"):
        train_step(state, pack_rollouts(make_rollouts(), np.zeros(16), 48, rows_per_micro=8))


def test_ess_scaled_step_shrinks_the_update_by_the_ess_fraction(params):
    # Stale behaviour logprobs: rho = pi_theta / pi_behav spreads, so the ESS fraction is well below 1.
    rollouts = make_rollouts(seed=5)
    plain_cfg = dataclasses.replace(BASE, clip_norm=None, weight_decay=0.0)
    scaled_cfg = dataclasses.replace(plain_cfg, ess_scaled_step=True)
    before = jax.tree.map(np.asarray, params)
    moved = {}
    for name, cfg in (("plain", plain_cfg), ("scaled", scaled_cfg)):
        state, m = train_step(create_train_state(cfg, MODEL, params), prepare_batch(cfg, rollouts))
        moved[name] = jax.tree.map(lambda a, b: np.asarray(a) - b, state.params, before)
        ess = float(m["ess_frac"])
    assert 0.05 < ess < 0.95
    assert float(m["ess_step_min"]) == pytest.approx(ess, rel=1e-5)  # one update: its ESS is the step's
    tree_close(moved["scaled"], jax.tree.map(lambda d: d * ess, moved["plain"]), rtol=2e-3, atol=1e-7)


def test_chunked_logprobs_give_the_same_loss_and_gradients(params):
    rollouts = make_rollouts(8, seed=11)
    whole = create_train_state(BASE, MODEL, params)
    chunked_cfg = dataclasses.replace(BASE, logits_chunk=16)  # 48-position rows in 3 chunks
    chunked = create_train_state(chunked_cfg, MODEL, params)
    l0, g0, m0 = loss_and_grads(whole, prepare_batch(BASE, rollouts))
    l1, g1, m1 = loss_and_grads(chunked, prepare_batch(chunked_cfg, rollouts))
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    assert float(m1["entropy_mean"]) == pytest.approx(float(m0["entropy_mean"]), rel=1e-6)
    tree_close(g1, g0, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="logits_chunk"):
        TrainConfig(token_budget=48, logits_chunk=32)


def test_unrolled_layers_give_the_same_loss_and_gradients(params):
    rollouts = make_rollouts(8, seed=12)
    scanned = create_train_state(BASE, MODEL, params)
    unrolled_cfg = dataclasses.replace(BASE, unroll_layers=True)
    unrolled = create_train_state(unrolled_cfg, MODEL, params)
    l0, g0, _ = loss_and_grads(scanned, prepare_batch(BASE, rollouts))
    l1, g1, _ = loss_and_grads(unrolled, prepare_batch(unrolled_cfg, rollouts))
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    tree_close(g1, g0, rtol=1e-5, atol=1e-7)
    tokens = jnp.zeros((2, 8), jnp.int32)
    hlo = lambda unroll: jax.jit(lambda p, t: forward(MODEL, p, t, t, unroll=unroll)).lower(params, tokens)
    assert "while" in hlo(False).as_text() and "while" not in hlo(True).as_text()  # the knob took effect


def test_kl_penalty_to_an_identical_reference_is_zero(params):
    rollouts = make_rollouts(8, seed=7)
    plain = create_train_state(BASE, MODEL, params)
    kl_cfg = dataclasses.replace(BASE, kl_coef=0.5, kl_estimator="k3")
    with_kl = create_train_state(kl_cfg, MODEL, params, ref_params=params)
    l0, g0, _ = loss_and_grads(plain, prepare_batch(BASE, rollouts))
    l1, g1, m1 = loss_and_grads(with_kl, prepare_batch(kl_cfg, rollouts))
    assert float(m1["kl_ref_mean"]) == pytest.approx(0.0, abs=1e-7)
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    tree_close(g1, g0, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="ref_params"):
        create_train_state(kl_cfg, MODEL, params)


def test_kl_to_the_reference_is_positive_once_the_policy_moved_and_its_gradient_points_back(params):
    # Equal rewards in every group: the GRPO advantages are 0, so the KL term is the whole loss.
    rollouts = [dataclasses.replace(r, reward=1.0) for r in make_rollouts(8, seed=9)]
    moved = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
    cfg = dataclasses.replace(BASE, kl_coef=1.0, kl_estimator="k3")
    batch = prepare_batch(cfg, rollouts)

    def kl_at(p):
        state = create_train_state(cfg, MODEL, p, ref_params=params)
        loss, grads, m = loss_and_grads(state, batch)
        assert float(loss) == pytest.approx(float(m["kl_ref_mean"]), rel=1e-5)  # token mean, coef 1
        return float(loss), grads

    kl, grads = kl_at(moved)
    assert kl > 1e-4
    # The gradient points back to the reference: a descent step shrinks the KL, and -grad is aligned
    # with (reference - policy).
    step = jax.tree.map(lambda p, g: p - 0.5 * g, moved, grads)
    assert kl_at(step)[0] < kl
    dot = sum(float(jnp.vdot(-g, r - p)) for g, r, p in
              zip(jax.tree.leaves(grads), jax.tree.leaves(params), jax.tree.leaves(moved), strict=True))
    assert dot > 0


def test_kl_reference_is_held_in_the_compute_dtype(params):
    cfg = dataclasses.replace(BASE, kl_coef=0.1, compute_dtype="bfloat16")
    state = create_train_state(cfg, MODEL, params, ref_params=params)
    assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_bf16_compute_keeps_fp32_master_weights(params):
    rollouts = make_rollouts(8, seed=8)
    f32 = create_train_state(BASE, MODEL, params)
    bf16 = create_train_state(dataclasses.replace(BASE, compute_dtype="bfloat16"), MODEL, params)
    assert bf16.model_cfg.dtype == "bfloat16"
    l32, _, _ = loss_and_grads(f32, prepare_batch(BASE, rollouts))
    state, m = train_step(bf16, prepare_batch(bf16.cfg, rollouts))
    assert float(m["loss"]) == pytest.approx(float(l32), rel=0.05, abs=0.02)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


def test_training_raises_the_likelihood_of_rewarded_completions(params):
    cfg = BASE
    rollouts = make_rollouts(16, seed=9)
    state = create_train_state(cfg, MODEL, params)
    batch = prepare_batch(cfg, rollouts)
    adv = batch.arrays["advantages"] * batch.arrays["loss_mask"]
    score = lambda s: float(np.sum(compute_logprobs(s, batch) * adv))  # advantage-weighted log-likelihood
    start = score(state)
    for _ in range(5):
        state, _ = train_step(state, batch)
    assert score(state) > start + 1.0


def test_schedule_and_config_validation(params):
    sched = learning_rate_schedule(TrainConfig(lr=1.0, warmup_steps=10, total_steps=110, end_lr_ratio=0.1))
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(60)) == pytest.approx(0.55) and float(sched(110)) == pytest.approx(0.1)
    for bad in (
        dict(loss="sft"),
        dict(prox_mode="exact"),
        dict(aggregation="sum"),
        dict(warmup_steps=5, total_steps=5),
        dict(compute_dtype="float16"),
        dict(rows_per_micro=0),
        dict(advantage="gae"),
    ):
        with pytest.raises(ValueError):
            TrainConfig(**bad)
    with pytest.raises(ValueError, match="multiple of fsdp"):
        create_train_state(
            dataclasses.replace(BASE, rows_per_micro=3),
            MODEL,
            params,
            mesh=make_mesh((2, 4), ("fsdp", "tensor")),
        )


def test_pack_rollouts_reads_the_train_sample_protocol_only():
    # Any object with the TrainSample attributes packs like the run's record (structural typing).
    r = make_rollouts(2)
    fields = ("prompt_tokens", "completion_tokens", "behav_logprobs", "versions", "reward", "group_id")
    plain = [types.SimpleNamespace(**{f: getattr(x, f) for f in fields}) for x in r]
    a = pack_rollouts(plain, [0.0, 1.0], 48).arrays
    b = pack_rollouts(r, [0.0, 1.0], 48).arrays
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_skip_zero_advantage_drops_uninformative_groups_without_changing_the_direction(params):
    rollouts = make_rollouts(16, seed=11)
    # Groups 0 and 1 get equal rewards throughout -> advantage 0 for their 8 sequences.
    rollouts = [
        dataclasses.replace(r, reward=float(r.group_id == 0)) if r.group_id < 2 else r for r in rollouts
    ]
    skip = dataclasses.replace(BASE, skip_zero_advantage=True)
    full, lean = prepare_batch(BASE, rollouts), prepare_batch(skip, rollouts)
    assert (full.num_sequences, full.num_skipped) == (16, 0)
    assert (lean.num_sequences, lean.num_skipped) == (8, 8)
    # token_mean: same policy-gradient sum, divided by fewer tokens -> gradient scaled by n_full / n_lean.
    _, g_full, _ = loss_and_grads(create_train_state(BASE, MODEL, params), full)
    _, g_lean, _ = loss_and_grads(create_train_state(skip, MODEL, params), lean)
    scale = full.num_loss_tokens / lean.num_loss_tokens
    tree_close(g_lean, jax.tree.map(lambda g: g * scale, g_full), rtol=1e-4, atol=1e-7)
    none = [dataclasses.replace(r, reward=0.0) for r in rollouts]  # nothing informative: keep everything
    assert prepare_batch(skip, none).num_sequences == 16
    with pytest.raises(ValueError, match="kl_coef"):
        TrainConfig(skip_zero_advantage=True, kl_coef=0.1)


def test_the_drift_split_separates_current_tokens_from_stale_ones(params):
    """Tokens sampled by the trainer's own version (lag 0) show the sampler/trainer mismatch alone: here
    none (on-policy behaviour logprobs); tokens three versions old show the drift the policy made since
    (behaviour logprobs 2 nats under the trainer's: log-ratio 2, above log(behav_cap = 5))."""
    from jaxrl_async.runtime.learner_log import drift_values

    cfg = dataclasses.replace(BASE, behav_mode="mask", behav_cap=5.0)
    state = create_train_state(cfg, MODEL, params)
    state = state.replace(version=state.version + 4)  # the trainer is at version 4
    current = make_rollouts(8, seed=1, version=4)
    stale = [dataclasses.replace(r, group_id=r.group_id + 10) for r in make_rollouts(8, seed=2, version=1)]
    batch = prepare_batch(cfg, current + stale)
    logp, mask = compute_logprobs(state, batch), batch.arrays["loss_mask"]
    shift = np.where(batch.arrays["versions"] == 4, 0.0, 2.0)
    batch.arrays["behav_logp"][...] = (logp - shift) * mask
    _, _, m = loss_and_grads(state, batch)
    got = drift_values({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
    n_cur = sum(len(r.completion_tokens) for r in current)
    n_stale = sum(len(r.completion_tokens) for r in stale)
    assert got["drift/log_ratio/lag0"] == pytest.approx(0.0, abs=1e-4)
    assert got["drift/over_cap_frac/lag0"] == 0.0
    assert got["drift/log_ratio/lag2_3"] == pytest.approx(2.0, abs=1e-4)
    assert got["drift/over_cap_frac/lag2_3"] == 1.0
    assert got["drift/token_frac/lag0"] == pytest.approx(n_cur / (n_cur + n_stale))
    assert not [k for k in got if "lag1" in k or "lag4_7" in k or "lag8_up" in k]  # empty bands: no tag
