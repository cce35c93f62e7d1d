"""benchmarks.lora_stats on constructed summaries (no training): reading a cell, picking LoRA's rate over the
pick seeds, pairing by seed, and the verdict against 2 points."""

import json

import pytest

from benchmarks import lora_stats


def _write(tmp_path, c, accs, steps=(0, 10, 20), expected=None):
    d = tmp_path / c["name"]
    d.mkdir()
    evals = [{"step": s, "accuracy": a} for s, a in zip(steps, accs, strict=True)]
    for e, x in zip(evals, expected or [None] * len(evals), strict=True):
        e["expected_reward"] = x
    (d / "summary.json").write_text(json.dumps({"steps": steps[-1], "evals": evals}))
    return lora_stats.read(c, str(d), 20)


def test_pick_pairs_by_seed_and_calls_the_verdict(tmp_path):
    full = {s: lora_stats.cell("full", s) for s in (0, 1, 2)}
    results = [_write(tmp_path, full[s], [0.4, 0.5, (0.61, 0.60, 0.62)[s]]) for s in (0, 1, 2)]
    # Seed 0 picks: 2e-3 ends highest there (0.62), though 4e-3 would win on seed 1, which is no pick seed.
    for lr, final in ((1e-3, 0.55), (2e-3, 0.62), (4e-3, 0.58)):
        results.append(_write(tmp_path, lora_stats.cell("lora", 0, lr, 8), [0.4, 0.5, final]))
    results.append(_write(tmp_path, lora_stats.cell("lora", 1, 4e-3, 8), [0.4, 0.5, 0.9]))
    assert results[0]["final"] == 0.61 and results[0]["run_mean"] == pytest.approx(0.555)
    assert lora_stats.pick_lr(results, 8, [0]) == 2e-3
    assert lora_stats.pick_lr(results, 8, [0, 1]) == 4e-3  # the one rate both pick seeds finished
    assert lora_stats.pick_lr(results, 8, [0, 2]) is None
    assert lora_stats.pick_lr(results, 16, [0]) is None

    # LoRA-best minus full per seed: +0.01, 0, 0; the 95% interval [-0.011, +0.018] lies above -2 points.
    for s, final in ((1, 0.60), (2, 0.62)):
        results.append(_write(tmp_path, lora_stats.cell("lora", s, 2e-3, 8), [0.4, 0.5, final]))
    gap = lora_stats.paired_gap(results, 8, 2e-3)
    assert gap["seeds"] == [0, 1, 2] and gap["mean"] == pytest.approx(0.01 / 3)
    assert gap["lo"] == pytest.approx(0.01 / 3 - 4.302652729911275 * (0.01 / 3**0.5) / 3**0.5)
    assert lora_stats.verdict(gap).startswith("within")
    table = lora_stats.table(results, 8, 2e-3, [0, 1, 2])
    assert "| LoRA r8 lr 0.002 | 0.620 (0.560) | 0.600 (0.550) | 0.620 (0.560) |" in table

    # A cell that stopped early is left out of the pairing, named as an error.
    short = _write(tmp_path, {**lora_stats.cell("lora", 2, 1e-3, 8), "name": "short"}, [0.4, 0.5], (0, 10))
    assert "no evaluation at step 20" in short["error"]
    assert lora_stats.paired_gap([*results[:3], short], 8, 1e-3)["n"] == 0


def test_verdict_against_two_points():
    assert lora_stats.verdict({"n": 3, "mean": -0.05, "lo": -0.08, "hi": -0.03}).startswith("more than 2")
    assert lora_stats.verdict({"n": 3, "mean": -0.02, "lo": -0.04, "hi": 0.0}).startswith("unresolved")
    assert lora_stats.verdict({"n": 3, "mean": 0.03, "lo": -0.01, "hi": 0.07}).startswith("within")
    assert lora_stats.verdict({"n": 1, "mean": 0.0, "lo": None, "hi": None}).startswith("too few")
    with pytest.raises(ValueError, match="a cell is"):
        lora_stats.cell("lora", 0)


def test_the_final_expected_reward_is_paired_where_every_cell_scored_it(tmp_path):
    # Runs that scored the expected reward (config.eval.expected_reward) are paired on it too; a cell
    # without it is left out of that pairing only, and a table with none of it prints no such line.
    results = [_write(tmp_path, lora_stats.cell("full", s), [0.4, 0.5, 0.6], expected=[0.3, 0.35, x])
               for s, x in ((0, 0.40), (1, 0.42), (2, 0.44))]
    lora = {s: lora_stats.cell("lora", s, 2e-3, 8) for s in (0, 1)}
    results += [_write(tmp_path, lora[s], [0.4, 0.5, 0.6], expected=[0.3, 0.35, x])
                for s, x in ((0, 0.41), (1, 0.44))]
    results.append(_write(tmp_path, lora_stats.cell("lora", 2, 2e-3, 8), [0.4, 0.5, 0.6]))
    assert results[0]["final_er"] == 0.40 and results[-1]["final_er"] is None
    gap = lora_stats.paired_gap(results, 8, 2e-3, "final_er")
    assert gap["seeds"] == [0, 1] and gap["mean"] == pytest.approx(0.015)
    assert lora_stats.paired_gap(results, 8, 2e-3)["seeds"] == [0, 1, 2]
    assert "final_er, paired over seeds [0, 1]: +0.015" in lora_stats.table(results, 8, 2e-3, [0, 1, 2])
    assert "final_er" not in lora_stats.table([results[0], results[5]], 8, 2e-3, [0, 2])
