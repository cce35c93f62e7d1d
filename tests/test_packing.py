"""First-fit-decreasing packing and the packed row layout."""

import numpy as np
import pytest

from jaxrl_async.rollouts import Rollout
from jaxrl_async.trainer.packing import ffd_bins, pack_rollouts, pad_rollouts

sample = Rollout.for_trainer  # the run's record, built as the trainer reads it


def test_ffd_places_longest_first_and_prefers_bins_with_fewest_sequences():
    # 8 -> bin0; 6 -> new bin1 (8 + 6 > 10); 2 fits both, equal counts -> earliest, bin0 (full);
    # then 2, 1, 1 fit only bin1.
    bins = ffd_bins([2, 8, 1, 6, 2, 1], capacity=10)
    assert bins == [[1, 0], [3, 4, 2, 5]]
    # With two bins open, equal-length items alternate to the bin holding fewer sequences (plain first-fit
    # would stack them all in bin0).
    assert ffd_bins([5, 5, 1, 1, 1], capacity=10, min_bins=2) == [[0, 2, 4], [1, 3]]


def test_ffd_respects_capacity_min_bins_and_multiple():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=40).tolist()
    for min_bins, multiple in [(1, 1), (6, 1), (1, 4), (3, 8)]:
        bins = ffd_bins(lengths, capacity=64, min_bins=min_bins, bins_multiple=multiple)
        assert sorted(i for b in bins for i in b) == list(range(40))
        assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
        assert len(bins) >= min_bins and len(bins) % multiple == 0
    assert len(ffd_bins([64] * 3, 64, bins_multiple=4)) == 4  # padded with an empty bin
    with pytest.raises(ValueError, match="exceeds the token budget"):
        ffd_bins([65], 64)


def test_ffd_caps_the_items_per_bin_and_pack_rollouts_the_sequences_per_row():
    """cuDNN's packed attention is built for a fixed number of segments per row (attention.max_segments):
    the packer puts no more sequences into a row, opening rows instead."""
    lengths = [1] * 20
    assert len(ffd_bins(lengths, capacity=64)) == 1
    bins = ffd_bins(lengths, capacity=64, max_items=8)
    assert [len(b) for b in bins] == [8, 8, 4]
    assert len(ffd_bins(lengths, capacity=64, bins_multiple=2, max_items=8)) == 4
    with pytest.raises(ValueError, match="max_items"):
        ffd_bins(lengths, 64, max_items=0)
    rs = [_rollout(2, 2, group=i) for i in range(10)]
    capped = pack_rollouts(rs, np.ones(10), token_budget=64, max_row_segments=3)
    seg = capped.arrays["segment_ids"]
    assert max(len(set(row[row != 0])) for row in seg) == 3 and seg.shape[0] == 4
    assert pack_rollouts(rs, np.ones(10), token_budget=64).arrays["segment_ids"].shape[0] == 1


def _rollout(p, c, v=0, reward=0.0, group=0):
    return sample(list(range(100, 100 + p)), list(range(200, 200 + c)), [-0.5] * c, [v] * c, reward, group)


def test_packed_layout_of_two_sequences():
    rs = [_rollout(3, 2, v=4), _rollout(2, 3, v=5)]
    b = pack_rollouts(rs, advantages=[1.5, -0.5], token_budget=10)
    a = b.micro_batch(0)
    assert b.num_micro == 1 and b.shape == (1, 10) and b.num_loss_tokens == 5 and b.num_sequences == 2
    # Both have 4 positions; ties keep input order: seq 0 then seq 1, then 2 padding positions.
    np.testing.assert_array_equal(a["tokens"][0], [100, 101, 102, 200, 100, 101, 200, 201, 0, 0])
    np.testing.assert_array_equal(a["targets"][0], [101, 102, 200, 201, 101, 200, 201, 202, 0, 0])
    np.testing.assert_array_equal(a["positions"][0], [0, 1, 2, 3, 0, 1, 2, 3, 0, 0])
    np.testing.assert_array_equal(a["segment_ids"][0], [1, 1, 1, 1, 2, 2, 2, 2, 0, 0])
    np.testing.assert_array_equal(a["loss_mask"][0], [0, 0, 1, 1, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(a["versions"][0] * a["loss_mask"][0], [0, 0, 4, 4, 0, 5, 5, 5, 0, 0])
    np.testing.assert_allclose(a["advantages"][0][a["loss_mask"][0] > 0], [1.5, 1.5, -0.5, -0.5, -0.5])
    np.testing.assert_allclose(a["behav_logp"][0][a["loss_mask"][0] > 0], -0.5)


def test_every_completion_token_appears_once_and_micro_shape_is_fixed():
    rng = np.random.default_rng(1)
    rs = [_rollout(int(rng.integers(1, 20)), int(rng.integers(1, 40))) for _ in range(30)]
    b = pack_rollouts(rs, np.arange(30, dtype=np.float32), token_budget=64, rows_per_micro=4, min_micro=2)
    assert b.arrays["tokens"].shape[1:] == (4, 64) and b.num_micro >= 2
    assert b.arrays["loss_mask"].sum() == sum(len(r.completion_tokens) for r in rs) == b.num_loss_tokens
    # each advantage value (= sequence index) covers exactly that sequence's completion tokens
    adv, mask = b.arrays["advantages"], b.arrays["loss_mask"] > 0
    for i, r in enumerate(rs):
        assert np.sum(adv[mask] == i) == len(r.completion_tokens)
    padded = pad_rollouts(rs, np.zeros(30), rows_per_micro=4)
    assert padded.arrays["loss_mask"].sum() == b.num_loss_tokens
    assert padded.arrays["tokens"].size > b.arrays["tokens"].size  # packing wastes less


def test_rejects_mismatched_rollouts():
    bad = sample([1, 2], [3, 4], [-0.1], [0, 0], 0.0, 0)
    with pytest.raises(ValueError, match="must match"):
        pack_rollouts([bad], [0.0], token_budget=16)
    with pytest.raises(ValueError, match="advantages"):
        pack_rollouts([_rollout(2, 2)], [0.0, 1.0], token_budget=16)


def test_split_groups_is_disjoint_balanced_seeded_and_keeps_groups_whole():
    from jaxrl_async.trainer.packing import batch_seed, pack_minibatches, split_groups

    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(12), 4)
    lengths = rng.integers(5, 40, size=groups.size)
    shares = split_groups(groups, lengths, 4, seed=7)
    assert sorted(i for s in shares for i in s) == list(range(groups.size))  # disjoint, complete
    assert all(len({groups[i] for i in s}) >= 1 for s in shares)
    for s in shares:  # whole groups
        assert all(set(np.flatnonzero(groups == g)) <= set(s) for g in {groups[i] for i in s})
    loads = [lengths[s].sum() for s in shares]
    biggest_group = max(lengths[groups == g].sum() for g in range(12))
    assert max(loads) - min(loads) <= biggest_group
    assert split_groups(groups, lengths, 4, seed=7) == shares  # seeded
    assert any(split_groups(groups, lengths, 4, seed=s) != shares for s in range(8, 12))  # shuffled
    assert batch_seed(0, [3, 1, 2]) == batch_seed(0, [2, 3, 1]) != batch_seed(1, [1, 2, 3])
    with pytest.raises(ValueError, match="config.trainer.minibatches=13"):
        split_groups(groups, lengths, 13, seed=0)
    completions = rng.integers(1, 20, groups.size)
    rs = [_rollout(2, int(n), group=int(g)) for g, n in zip(groups, completions, strict=True)]
    b = pack_minibatches(rs, np.ones(len(rs)), 64, rows_per_micro=2, minibatches=4, seed=3)
    assert len(b.updates) == 4 and sum(b.updates) == b.num_micro and all(u >= 1 for u in b.updates)
    assert b.num_loss_tokens == sum(len(r.completion_tokens) for r in rs)
