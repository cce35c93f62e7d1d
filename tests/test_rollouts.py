"""Staleness admission, the rollout queue, staleness statistics and trainer -> sampler weight sync."""

import jax
import numpy as np
import pytest

from jaxrl_async.model import init_params, param_shardings, presets
from jaxrl_async.rollouts import Rollout, RolloutQueue, StalenessController, staleness_stats
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, make_mesh


def _rollout(group, idx, versions, reward=1.0):
    n = len(versions)
    return Rollout(
        uid=f"p{group}",
        group_id=group,
        sample_index=idx,
        prompt_tokens=np.zeros(3, np.int32),
        completion_tokens=np.arange(n, dtype=np.int32),
        behav_logprobs=np.zeros(n, np.float32),
        versions=np.asarray(versions, np.int32),
        reward=reward,
    )


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_admission_never_runs_more_than_eta_versions_ahead(max_staleness):
    ctl = StalenessController(batch_prompts=4, max_staleness=max_staleness)
    rng = np.random.default_rng(0)
    version = 0
    for _ in range(400):
        if rng.random() < 0.8 and ctl.can_admit(version):
            n = ctl.admit(version) + 1
            assert (n - 1) // 4 <= version + max_staleness
        elif rng.random() < 0.3:
            version += 1
        assert ctl.ahead(version) <= max_staleness
    # With no training, admission stops after (max_staleness + 1) batches.
    ctl = StalenessController(batch_prompts=4, max_staleness=max_staleness)
    while ctl.can_admit(0):
        ctl.admit(0)
    assert ctl.started == 4 * (max_staleness + 1)
    with pytest.raises(RuntimeError):
        ctl.admit(0)


def test_queue_hands_out_oldest_groups_first_and_only_whole_groups():
    q = RolloutQueue(group_size=2)
    q.add(_rollout(0, 0, [3, 3]))
    q.add(_rollout(1, 0, [1, 2]))
    q.add(_rollout(1, 1, [2, 2]))
    assert q.ready_groups() == 1 and q.pending_samples() == 1
    q.add(_rollout(0, 1, [3]))
    q.add(_rollout(2, 1, [0]))
    q.add(_rollout(2, 0, [0, 5]))
    batch = q.pop_batch(2, trainer_version=5)
    assert [g[0].group_id for g in batch] == [2, 1]  # start versions 0 then 1
    assert [r.sample_index for r in batch[0]] == [0, 1]
    assert q.pop_batch(2, trainer_version=5) is None and q.ready_groups() == 1


def test_head_staleness_cap_drops_and_records_lengths():
    q = RolloutQueue(group_size=1, max_head_staleness=2)
    q.add(_rollout(0, 0, [0, 1, 2, 3]))  # head staleness 5 at version 5
    q.add(_rollout(1, 0, [4, 5]))
    batch = q.pop_batch(1, trainer_version=5)
    assert batch[0][0].group_id == 1
    assert q.dropped_groups == 1 and q.dropped_lengths == [4]


def test_staleness_stats_head_vs_token():
    stats = staleness_stats([[_rollout(0, 0, [1, 1, 4, 5])], [_rollout(1, 0, [5])]], trainer_version=5)
    assert stats["head_max"] == 4 and stats["head_mean"] == 2.0
    np.testing.assert_array_equal(np.sort(stats["token_values"]), [0, 0, 1, 4, 4])
    assert stats["token_mean"] == pytest.approx(9 / 5)
    assert stats["mixed_frac"] == 0.5  # the first sample's tokens came from versions 1, 4 and 5


def test_weight_sync_reshards_into_sampler_layout_and_keeps_values():
    cfg = presets.tiny(vocab_size=64)
    devs = jax.devices()
    trainer_mesh = make_mesh((2, 2), ("fsdp", "tensor"), devs[4:])
    sampler_mesh = make_mesh((2, 2), ("data", "tensor"), devs[:4])
    params = init_params(cfg, jax.random.key(0), trainer_mesh, TRAINER_RULES)
    sync = WeightSync(cfg, sampler_mesh)
    out = sync(params)
    want = param_shardings(cfg, sampler_mesh, SAMPLER_RULES)
    for a, b, sh in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        assert b.sharding == sh
        assert {d.id for d in b.devices()} <= {d.id for d in devs[:4]}
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sync.count == 1 and sync.last_seconds > 0
    back = jax.device_put(out, param_shardings(cfg, trainer_mesh, TRAINER_RULES))  # round trip is identity
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
