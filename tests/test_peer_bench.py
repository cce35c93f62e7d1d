"""The peer benchmark's shared task (benchmarks.bench_peers): the Hugging Face export with our token ids, the
prompt dump, the spec, and the drivers' schedule and reward against ours. No peer venv is needed."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from benchmarks import peer_bench as pb
from configs import tiny_arith
from jaxrl_async.data import held_out_prompts, make_prompt_iterator
from jaxrl_async.model import forward_logits, init_params
from jaxrl_async.rewards.registry import get_reward
from jaxrl_async.run_config import validate
from jaxrl_async.runtime import build
from jaxrl_async.trainer.optimizer import learning_rate_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _common():
    """The drivers' common.py, loaded as the drivers load it (a file, not a package module)."""
    path = os.path.join(REPO, "benchmarks", "peer_drivers", "common.py")
    spec = importlib.util.spec_from_file_location("peer_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, **overrides):
    c = tiny_arith.get_config()
    c.workdir = str(tmp_path / "run")
    c.eval_prompts = 50
    for k, v in overrides.items():
        setattr(c, k, v)
    return validate(c, len(jax.devices()))


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_prompt_dump_is_our_pipeline_in_our_order_with_disjoint_splits(tmp_path):
    run = _run(tmp_path, prompts_per_step=16)
    tok = build.build_tokenizer(run)
    paths = pb.dump_prompts(run, tok, str(tmp_path), steps=3)
    train, held = _rows(paths["train"]), _rows(paths["heldout"])
    assert len(train) == 3 * 16 and len(held) == 50
    it = make_prompt_iterator(run.data, tok)
    ours = [next(it) for _ in range(len(train))]
    assert [r["prompt"] for r in train] == [p.text for p in ours]  # the order our run draws them
    assert [r["answer"] for r in train] == [p.answer for p in ours]
    assert [r["prompt"] for r in held] == [p.text for p in held_out_prompts(run.data, tok, 50)]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in train + held:
        assert r["prompt_ids"] == tok.encode(r["prompt"]) and r["reward"] == "arithmetic" and r["weight"] == 1
        assert str(eval(r["prompt"][:-1])) == r["answer"]  # "37+85=" -> "122"


def test_export_loads_in_transformers_with_our_ids_and_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    run = _run(tmp_path)
    tok = build.build_tokenizer(run)
    cfg = build.model_config(run, tok)
    params = init_params(cfg, jax.random.key(0))
    model_dir = pb.export_model(cfg, params, tok, str(tmp_path))
    paths = pb.dump_prompts(run, tok, str(tmp_path), steps=1)
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for r in _rows(paths["train"]) + _rows(paths["heldout"]):
        assert hf_tok(r["prompt"], add_special_tokens=False)["input_ids"] == r["prompt_ids"]
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.eos_id, tok.pad_id)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = np.asarray([tok.encode("37+85=")], np.int32)
    ours = np.asarray(forward_logits(cfg, params, ids))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4)


def test_spec_carries_our_settings_and_the_drivers_schedule_and_reward_are_ours(tmp_path):
    run = _run(tmp_path)
    tok = build.build_tokenizer(run)
    spec = pb.make_spec(run, "m", {"train": "t", "heldout": "h"}, 150, tok, threads=1)
    assert (spec.prompts_per_step, spec.samples_per_prompt, spec.max_new_tokens) == (64, 8, 6)
    assert (spec.lr, spec.warmup_steps, spec.schedule_steps, spec.end_lr_ratio) == (3e-4, 5, 1000, 0.1)
    spec.write(str(tmp_path / "spec.json"))
    common = _common()
    loaded = common.load_spec(str(tmp_path / "spec.json"))
    ours = learning_rate_schedule(run.trainer)
    for step in (0, 1, 4, 5, 6, 100, 999, 1000, 1200):
        assert common.lr_at(loaded, step) == pytest.approx(float(ours(step)), rel=1e-5, abs=1e-12), step
    for kind in ("arithmetic", "shift"):  # letter_range: below, from its own prompts' metadata
        grade = get_reward(kind)
        for answer, completion in (("122", "122"), ("122", " 122 "), ("122", "12"), ("51024", "51000")):
            assert common.reward(kind, completion, answer) == grade("", completion, {"answer": answer})


def test_letter_range_dump_answers_and_the_drivers_reward_are_ours(tmp_path):
    """The long-tail task's rows carry the span our verifier rebuilds from the prompt's metadata, and the
    drivers' exact-match reward grades completions as ours does."""
    from configs import letter_range

    c = letter_range.get_config()
    c.workdir, c.eval_prompts = str(tmp_path / "run"), 40
    run = validate(c, len(jax.devices()))
    tok = build.build_tokenizer(run)
    paths = pb.dump_prompts(run, tok, str(tmp_path), steps=1)
    rows = _rows(paths["train"]) + _rows(paths["heldout"])
    it = make_prompt_iterator(run.data, tok)
    ours = [next(it) for _ in range(run.schedule.prompts_per_step)]
    common, grade = _common(), get_reward("letter_range")
    assert {r["reward"] for r in rows} == {"letter_range"}
    for r, p in zip(rows, ours, strict=False):
        assert r["prompt"] == p.text and r["answer"] == p.answer
        for completion in (p.answer, f" {p.answer} ", p.answer[:-1] or "?", p.answer + "x"):
            ours_grade = grade(p.text, completion, p.metadata)
            assert common.reward("letter_range", completion, r["answer"]) == ours_grade
    assert max(len(r["answer"]) for r in rows) > 4 * np.median([len(r["answer"]) for r in rows])
    # The held-out rows carry our weights: a driver's weighted accuracy is the number our runs log.
    held = _rows(paths["heldout"])
    assert [r["weight"] for r in held] == [p.weight for p in held_out_prompts(run.data, tok, 40)]
    assert len({r["weight"] for r in held}) > 1


def test_step0_check_time_to_target_and_table():
    assert pb.step0_check({"ours": 0.35, "trl": 0.35}, 0.0)[0]
    ok, msg = pb.step0_check({"ours": 0.35, "tunix": 0.30}, 0.01)
    assert not ok and "DIFFERS" in msg and "tunix 0.3000" in msg
    assert not pb.step0_check({"ours": 0.35, "trl": None}, 1.0)[0]
    evals = [{"step": 0, "accuracy": 0.3, "elapsed_s": 0.0}, {"step": 20, "accuracy": 0.6, "elapsed_s": 9.0},
             {"step": 40, "accuracy": 0.8, "elapsed_s": 20.0}]  # fmt: skip
    assert pb.time_to_target(evals, 0.7) == 20.0 and pb.time_to_target(evals, 0.9) is None
    trl = {"evals": evals, "trained_tokens": 1000, "train_s": 20.0, "version": "1.16.0"}
    rep = pb.report({"trl": trl}, 0.7)
    assert rep["rows"][0]["train_tokens_per_s"] == 50.0 and rep["rows"][0]["final_accuracy"] == 0.8
    assert rep["rows"][0]["steady_s_per_step"] == pytest.approx(11.0 / 20)  # step 20 -> 40
    assert "| trl 1.16.0 | 40 | 0.300 | 0.800 | 20.0 | 50 | 0.550 |  |" in pb.table(rep)
    timed = pb.report({"trl": {**trl, "process_s": 31.4}}, 0.7)
    assert "| 0.550 | 31 |" in pb.table(timed)
    assert pb.steady_s_per_step(evals[:2]) is None
    untimed = pb.report({"trl": trl}, None)
    assert untimed["rows"][0]["time_to_target_s"] is None and "| no target |" in pb.table(untimed)
    with pytest.raises(ValueError, match="--peers"):
        pb.parse_frameworks("trl,vllm")


def test_the_run_order_rotates_per_seed_and_the_noskip_variants_train_every_group():
    names = "ours_sync,ours_sync_noskip,trl,tunix"
    assert pb.parse_frameworks(names) == names.split(",")
    assert pb.parse_frameworks(names, 1) == ["ours_sync_noskip", "trl", "tunix", "ours_sync"]
    assert pb.parse_frameworks(names, 6) == pb.parse_frameworks(names, 2)  # seed 6 runs as seed 2
    with pytest.raises(ValueError, match="--peers: .* twice"):
        pb.parse_frameworks("trl,trl")
    assert pb.our_mode_flags("ours_sync") == ["--config.mode=sync"]
    assert pb.our_mode_flags("ours_async_noskip") == ["--config.mode=async",
                                                      "--config.trainer.skip_zero_advantage=False"]


def _seed_run(out, sync, asyn, trl, step0=0.3):
    """A finished run's bench_peers.json: each framework's accuracies at steps 0, 50 and 100 (25 s a step
    for TRL, 1 s for ours)."""
    def evals(accs, s_per_step):
        steps = (0, 50, 100)
        pairs = zip(steps, accs, strict=True)
        return [{"step": k, "accuracy": a, "elapsed_s": k * s_per_step} for k, a in pairs]

    results = {"ours_sync": {"evals": evals((step0, *sync), 1.0), "train_tokens_per_s": 100.0, "version": ""},
               "ours_async": {"evals": evals((step0, *asyn), 0.5), "train_tokens_per_s": 180.0,
                              "version": "(max_staleness 2, 2 processes)"},
               "trl": {"evals": evals((step0, *trl), 2.5), "trained_tokens": 500, "train_s": 250.0,
                       "version": "1.16.0", "process_s": 300.0}}  # fmt: skip
    rep = {**pb.report(results, None), "step0": {"accuracies": {"ours": step0, "trl": step0}},
           "results": results}  # fmt: skip
    os.makedirs(out)
    with open(os.path.join(out, "bench_peers.json"), "w") as f:
        json.dump(rep, f)
    return rep


def test_seeds_read_back_together_at_their_own_or_one_target(tmp_path):
    a = _seed_run(tmp_path / "s0", sync=(0.40, 0.45), asyn=(0.46, 0.44), trl=(0.38, 0.46))
    b = _seed_run(tmp_path / "s1", sync=(0.42, 0.50), asyn=(0.40, 0.45), trl=(0.41, 0.43))
    own = pb.seeds_summary([a, b], None)  # targets 0.44 and 0.49
    assert [r["target"] for r in own["runs"]] == pytest.approx([0.44, 0.49])
    assert own["runs"][0]["hit"]["ours_async"]["step"] == 50 and own["runs"][1]["hit"]["ours_async"] is None
    # seed 0: TRL at 250 s, sync at 100 s, async at 25 s; seed 1: TRL missed (its clock stopped at 250 s)
    assert own["ratios"][("ours_sync", "trl")] == [("", 2.5), (">", 2.5)]
    assert own["ratios"][("ours_async", "trl")] == [("", 10.0), None]
    assert own["per"]["trl"]["finals"] == [0.46, 0.43] and own["per"]["trl"]["tok_s"] == [2.0, 2.0]
    assert own["per"]["ours_sync"]["mean_eval"] == pytest.approx((0.40 + 0.45 + 0.42 + 0.50) / 4)
    text = pb.seeds_tables(own, ["s0", "s1"])
    assert "| s1 | 0.490 | 100.0 (step 100) | not reached (> 50.0) | not reached (> 250.0) |" in text
    assert "| trl / ours_sync | 2.50x | >2.50x |" in text
    assert "| trl / ours_async | 10.00x | not reached by ours |" in text
    assert "| trl 1.16.0 | 0.460 / 0.430 (0.445) |" in text
    one = pb.seeds_summary([a, b], 0.40)  # one target for both: TRL at step 100 in seed 0, 50 in seed 1
    assert [r["hit"]["trl"]["step"] for r in one["runs"]] == [100, 50]
    assert one["ratios"][("ours_sync", "trl")] == [("", 5.0), ("", 2.5)]


def test_report_flag_prints_finished_runs_and_refuses_a_missing_one(tmp_path):
    import subprocess
    import sys

    _seed_run(tmp_path / "s0", sync=(0.40, 0.45), asyn=(0.46, 0.44), trl=(0.38, 0.46))
    _seed_run(tmp_path / "s1", sync=(0.42, 0.50), asyn=(0.40, 0.45), trl=(0.41, 0.43))
    tool = ["-m", "benchmarks.bench_peers"]
    res = subprocess.run([sys.executable, *tool, f"--report={tmp_path / 's0'},{tmp_path / 's1'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "target 0.4900" in res.stdout and "| trl / ours_sync | 2.50x | >2.50x |" in res.stdout
    res = subprocess.run([sys.executable, *tool, f"--report={tmp_path / 'nope'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode != 0 and "--report" in res.stderr and "bench_peers.json" in res.stderr


def test_drivers_import_nothing_of_this_package():
    """The drivers run in the peers' venvs, where jaxrl_async is not installed: common.py imports only the
    standard library, and each driver only common, the standard library and its peer's stack."""
    import ast
    import sys

    folder = os.path.join(REPO, "benchmarks", "peer_drivers")
    for name in ("common.py", *pb.DRIVERS.values()):
        with open(os.path.join(folder, name)) as f:
            tree = ast.parse(f.read())
        roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "jaxrl_async" not in roots and "configs" not in roots, name
        if name == "common.py":
            assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_the_stop_token_goes_back_on_completions_that_ended_on_it():
    """Tunix's sampler cuts the stop token; its driver puts it back on every completion shorter than the
    new-token limit (those ended on the stop), so the loss covers the stop decision; a completion at the
    limit was cut there and gets none."""
    common = _common()
    cut = [np.asarray([5, 6], np.int32), np.asarray([], np.int32), np.asarray([7, 8, 9], np.int32)]
    assert common.with_stop_token(cut, 3, 2) == [[5, 6, 2], [2], [7, 8, 9]]
