"""The peer benchmark's parts (`benchmarks/bench_peers.py`; a module here that is no command, so importing it
defines no flags): the peers' virtual environments, the shared task on disk (our warm start as a Hugging
Face directory with our token ids, the train and held-out prompts as JSONL, one JSON spec of the GRPO
settings), the drivers that run each peer's own GRPO loop, and reading every framework's results back
into one side-by-side report.

Every framework reads the same spec: the model and warm start (the export), the prompts in the order our
run consumes them, the reward, the batch shape (prompts x samples per step, new tokens, temperature), the
learning-rate schedule (linear warmup, cosine decay to a floor, AdamW, global-norm clip) and the clip
range. A peer's driver is a script of ours (benchmarks/peer_drivers/) copied beside the spec and run
with that peer's own interpreter: it imports nothing of this package, only the peer and its stack.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

# Each peer's venv: the pip requirements it is built from (written into the venv's marker, so a venv built
# from other requirements is rebuilt). TRL at the version pip serves, with CPU torch (served locally);
# Tunix pins safetensors<0.8, which our stack does not accept, hence a venv of its own.
PEERS = {
    "trl": ("torch==2.13.0", "transformers>=5,<6", "trl", "datasets"),
    "tunix": ("google-tunix==0.1.7",),
}
# Ours in each mode, and again with `trainer.skip_zero_advantage=False`: every group trained, as the peers'
# loops do, so a comparison can say how much of a lead is that skipping.
OURS = ("ours_sync", "ours_async", "ours_sync_noskip", "ours_async_noskip")
FRAMEWORKS = (*OURS, *PEERS)
DRIVERS = {"trl": "trl_grpo.py", "tunix": "tunix_grpo.py"}
# Peers whose driver runs the step-0 check only (the reason is printed and kept in the report).
STEP0_ONLY: dict[str, str] = {}
_DRIVER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_drivers")
_MARKER = "jaxrl-bench-requirements.json"
# The verifiers the drivers reimplement (peer_drivers/common.py).
REWARDS = ("arithmetic", "letter_range", "shift")


def parse_frameworks(text: str, rotate: int = 0) -> list[str]:
    """ "trl,ours_sync" -> ["trl", "ours_sync"], in the order they run: rotated left by `rotate` places (a
    seed loop passes its seed, so no framework always runs first or last on a warming machine). An unknown
    or repeated name is an error naming --peers."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise ValueError(f"--peers: {unknown or text!r} not in {FRAMEWORKS}")
    if len(set(names)) != len(names):
        raise ValueError(f"--peers: {text!r} names a framework twice")
    k = rotate % len(names)
    return names[k:] + names[:k]


def our_mode_flags(name: str) -> list[str]:
    """The config overrides of one of OURS: its mode, and zero-advantage skipping off for the _noskip
    variants (after the user's overrides: a later flag wins)."""
    mode = "sync" if name.startswith("ours_sync") else "async"
    skip = ["--config.trainer.skip_zero_advantage=False"] if name.endswith("_noskip") else []
    return [f"--config.mode={mode}", *skip]


# ----- virtual environments -----


def venv_python(venvs: str, peer: str) -> str:
    return os.path.join(venvs, peer, "bin", "python")


def ensure_venv(venvs: str, peer: str, log_path: str) -> str:
    """The peer's interpreter, building its venv first unless one built from PEERS[peer] is there."""
    root = os.path.join(venvs, peer)
    marker = os.path.join(root, _MARKER)
    want = list(PEERS[peer])
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                return venv_python(venvs, peer)
        shutil.rmtree(root)  # built from other requirements: start over
    os.makedirs(venvs, exist_ok=True)
    with open(log_path, "w") as log:
        for cmd in ([sys.executable, "-m", "venv", root],
                    [venv_python(venvs, peer), "-m", "pip", "install", "-q", *want]):  # fmt: skip
            print(f"{peer}: {' '.join(cmd)}", flush=True)
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building the {peer} venv failed: see {log_path}")
    with open(marker, "w") as f:
        json.dump(want, f)
    return venv_python(venvs, peer)


# ----- the shared task -----


def prompt_rows(prompts, reward: str) -> list[dict]:
    """JSONL rows of Prompts: the rendered text (what our sampler decodes from), our token ids of it, the
    answer the reward compares with, the reward's name and the prompt's weight in a held-out accuracy."""
    return [{"uid": p.uid, "prompt": p.text, "prompt_ids": [int(t) for t in p.tokens], "answer": p.answer,
             "reward": reward, "weight": float(p.weight)} for p in prompts]  # fmt: skip


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def dump_prompts(run, tokenizer, out: str, steps: int) -> dict[str, str]:
    """Writes OUT/train.jsonl (the first `steps` batches of prompts in the order our run draws them) and
    OUT/heldout.jsonl (the run's evaluation set); returns their paths."""
    from jaxrl_async.data import held_out_prompts, make_prompt_iterator

    reward = task_reward(run)
    it = make_prompt_iterator(run.data, tokenizer)
    train = [next(it) for _ in range(steps * run.schedule.prompts_per_step)]
    heldout = held_out_prompts(run.data, tokenizer, run.eval.prompts)
    paths = {"train": os.path.join(out, "train.jsonl"), "heldout": os.path.join(out, "heldout.jsonl")}
    write_jsonl(prompt_rows(train, reward), paths["train"])
    write_jsonl(prompt_rows(heldout, reward), paths["heldout"])
    return paths


def task_reward(run) -> str:
    from jaxrl_async.run_config import TASK_REWARD

    name = run.reward.reward or TASK_REWARD.get(run.data.task, "")
    if name not in REWARDS:
        raise ValueError(
            f"config.data.task={run.data.task!r} / config.reward.reward={run.reward.reward!r}: the peers' "
            f"drivers implement the rewards {REWARDS} only"
        )
    return name


def export_model(model_cfg, params, tokenizer, out: str) -> str:
    """Our parameters as a Hugging Face directory with our tokenizer's ids; returns its path."""
    from jaxrl_async.model import save_hf

    path = os.path.join(out, "model")
    save_hf(model_cfg, params, path)
    if not hasattr(tokenizer, "save_hf"):
        raise ValueError("config.tokenizer: the peer benchmark needs the built-in 'char' tokenizer")
    tokenizer.save_hf(path)
    return path


@dataclasses.dataclass(frozen=True)
class Spec:
    """The GRPO settings every framework runs with (written as OUT/spec.json, read by the drivers)."""

    model_dir: str
    train_jsonl: str
    heldout_jsonl: str
    reward: str
    steps: int
    eval_every: int
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    lr: float
    warmup_steps: int
    schedule_steps: int  # the cosine's length (trainer.total_steps), whatever `steps` is
    end_lr_ratio: float
    b1: float
    b2: float
    adam_eps: float
    weight_decay: float
    clip_norm: float | None
    eps_low: float
    eps_high: float
    eos_id: int
    pad_id: int
    seed: int
    threads: int

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)


def make_spec(run, model_dir: str, paths: dict[str, str], steps: int, tokenizer, threads: int) -> Spec:
    t, s = run.trainer, run.sampler
    return Spec(
        model_dir=model_dir, train_jsonl=paths["train"], heldout_jsonl=paths["heldout"],
        reward=task_reward(run), steps=steps, eval_every=run.eval.every or steps,
        prompts_per_step=run.schedule.prompts_per_step, samples_per_prompt=run.schedule.samples_per_prompt,
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, lr=t.lr, warmup_steps=t.warmup_steps,
        schedule_steps=t.total_steps, end_lr_ratio=t.end_lr_ratio, b1=t.b1, b2=t.b2, adam_eps=t.adam_eps,
        weight_decay=t.weight_decay, clip_norm=t.clip_norm, eps_low=t.eps_low, eps_high=t.eps_high,
        eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, seed=run.seed, threads=threads,
    )  # fmt: skip


def driver_command(python: str, peer: str, out: str, spec: str, result: str, step0: bool) -> list[str]:
    """Copies the peer's driver (and the helpers it shares) into OUT/drivers and returns its command."""
    dest = os.path.join(out, "drivers")
    os.makedirs(dest, exist_ok=True)
    for name in ("common.py", DRIVERS[peer]):
        shutil.copy(os.path.join(_DRIVER_DIR, name), os.path.join(dest, name))
    return [python, os.path.join(dest, DRIVERS[peer]), spec, result, *(["--step0"] if step0 else [])]


# ----- results -----


def read_peer(path: str) -> dict:
    """A driver's result: {framework, version, patches, evals [{step, accuracy, elapsed_s}], trained_tokens,
    train_s, ...}; elapsed_s there excludes the driver's own evaluation time (it blocks its loop)."""
    with open(path) as f:
        return json.load(f)


def read_ours(workdir: str, name: str) -> dict:
    """Our run's summary.json in the drivers' result form. Evaluations run beside training, so elapsed_s
    is when the evaluated version's train step ended (trained_s, seconds since the learner started), not
    when its evaluation finished: the drivers' clocks leave their evaluations out too."""
    with open(os.path.join(workdir, "summary.json")) as f:
        s = json.load(f)
    evals = [{"step": e["step"], "accuracy": e["accuracy"],
              "elapsed_s": e["trained_s"] if e.get("trained_s") is not None else e["elapsed_s"]}
             for e in s["evals"]]  # fmt: skip
    procs = s.get("processes", 1)
    where = f"(max_staleness {s['max_staleness']}, {procs} process{'es' if procs > 1 else ''})"
    return {"framework": name, "version": where if s["max_staleness"] else "", "evals": evals,
            "train_tokens_per_s": s["train_tokens_per_s"],
            "steps": s["steps"], "wall_s": s["wall_s"], "mode": s["mode"],
            "max_staleness": s["max_staleness"]}  # fmt: skip


def _reached(evals: list[dict], target: float) -> dict | None:
    """The first evaluation at or above `target` ({step, accuracy, elapsed_s}), or None."""
    return next((e for e in sorted(evals, key=lambda e: e["step"]) if e["accuracy"] >= target), None)


def time_to_target(evals: list[dict], target: float) -> float | None:
    """Seconds to the first evaluation at or above `target` (None: never reached)."""
    hit = _reached(evals, target)
    return None if hit is None else hit["elapsed_s"]


def steady_s_per_step(evals: list[dict]) -> float | None:
    """Seconds per step between the first evaluation after step 0 and the last: the same span for every
    framework, past our compilation and each loop's warm-up (None with fewer than two such evaluations)."""
    later = sorted((e for e in evals if e["step"] > 0), key=lambda e: e["step"])
    if len(later) < 2:
        return None
    return (later[-1]["elapsed_s"] - later[0]["elapsed_s"]) / (later[-1]["step"] - later[0]["step"])


def step0(result: dict) -> float | None:
    return next((e["accuracy"] for e in result["evals"] if e["step"] == 0), None)


def step0_check(accuracies: dict[str, float | None], tolerance: float) -> tuple[bool, str]:
    """Whether every framework's step-0 held-out greedy accuracy is within `tolerance` of the others."""
    known = {k: v for k, v in accuracies.items() if v is not None}
    missing = sorted(set(accuracies) - set(known))
    listing = ", ".join(f"{k} {v:.4f}" for k, v in known.items())
    if missing:
        return False, f"step-0 accuracy missing for {missing} ({listing})"
    spread = max(known.values()) - min(known.values()) if known else 0.0
    ok = spread <= tolerance + 1e-12
    return ok, f"step-0 held-out greedy accuracy {'equal' if ok else 'DIFFERS'}: {listing} " \
               f"(spread {spread:.4f}, tolerance {tolerance})"


def report(results: dict[str, dict], target: float | None) -> dict:
    """Rows per framework: step-0 and final accuracy, seconds to `target`, trained tokens/s."""
    rows = []
    for name, r in results.items():
        evals = sorted(r["evals"], key=lambda e: e["step"])
        rate = r.get("train_tokens_per_s")
        if rate is None and r.get("train_s"):
            rate = r["trained_tokens"] / r["train_s"]
        rows.append({"framework": name, "version": r.get("version", ""), "steps": evals[-1]["step"] if evals
                     else 0, "step0_accuracy": step0(r), "final_accuracy": evals[-1]["accuracy"] if evals
                     else None, "time_to_target_s": None if target is None else time_to_target(evals, target),
                     "steady_s_per_step": steady_s_per_step(evals),
                     "train_tokens_per_s": rate, "process_s": r.get("process_s"),
                     "patches": r.get("patches", [])})  # fmt: skip
    return {"target_accuracy": target, "rows": rows}


def table(rep: dict) -> str:
    f = lambda v, p: "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{p}f}"
    goal = "no target" if rep["target_accuracy"] is None else f"s to {rep['target_accuracy']:.2f}"
    heads = ("framework", "steps", "step-0 acc", "final acc", goal, "trained tok/s", "s/step (steady)",
             "process s")  # fmt: skip
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rep["rows"]:
        name = f"{r['framework']} {r['version']}".strip()
        ttt = f(r["time_to_target_s"], 1) or ("not reached" if rep["target_accuracy"] is not None else "")
        cols = [name, str(r["steps"]), f(r["step0_accuracy"], 3), f(r["final_accuracy"], 3), ttt,
                f(r["train_tokens_per_s"], 0), f(r["steady_s_per_step"], 3),
                f(r["process_s"], 0)]  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


# ----- several runs (seeds) read back together -----


def seeds_summary(reps: list[dict], target: float | None) -> dict:
    """Finished runs of `bench_peers.json` (one per seed) read back at one target: `target`, or None for
    each run's own (ours_sync's final accuracy minus one point). Per run and framework: the first evaluation
    at the target, else the clock at its last evaluation (the time to the target is longer than that: a
    lower bound). Per framework: finals, the mean of the evaluations after step 0, steady seconds per step,
    trained tokens/s and process seconds. Per pair (ours, peer): the peer's time to the target over ours,
    per run, '>' where only the peer missed it (its last clock over our time)."""
    runs, frameworks = [], []
    for rep in reps:
        res = rep["results"]
        frameworks += [f for f in res if f not in frameworks]
        want = target if target is not None else res["ours_sync"]["evals"][-1]["accuracy"] - 0.01
        hit = {f: _reached(r["evals"], want) for f, r in res.items()}
        last = {f: max(r["evals"], key=lambda e: e["step"])["elapsed_s"] for f, r in res.items()}
        runs.append({"target": want, "step0": rep["step0"]["accuracies"], "hit": hit, "last_s": last})
    per = {}
    for f in frameworks:
        rows = [next(r for r in rep["rows"] if r["framework"] == f) for rep in reps if f in rep["results"]]
        later = [[e["accuracy"] for e in rep["results"][f]["evals"] if e["step"] > 0] for rep in reps
                 if f in rep["results"]]  # fmt: skip
        later = [statistics.fmean(accs) for accs in later if accs]  # each run's mean, then their mean
        per[f] = {"version": rows[0]["version"], "finals": [r["final_accuracy"] for r in rows],
                  "mean_eval": statistics.fmean(later) if later else None,
                  "steady": [r["steady_s_per_step"] for r in rows if r["steady_s_per_step"] is not None],
                  "tok_s": [r["train_tokens_per_s"] for r in rows if r["train_tokens_per_s"] is not None],
                  "process_s": [r["process_s"] for r in rows if r["process_s"] is not None]}  # fmt: skip
    ratios = {}
    for ours in (f for f in frameworks if f in OURS):
        for peer in (f for f in frameworks if f in PEERS):
            cells = []
            for run in runs:
                mine, theirs = run["hit"].get(ours), run["hit"].get(peer)
                if mine is None or peer not in run["last_s"]:
                    cells.append(None)
                elif theirs is None:
                    cells.append((">", run["last_s"][peer] / mine["elapsed_s"]))
                else:
                    cells.append(("", theirs["elapsed_s"] / mine["elapsed_s"]))
            ratios[(ours, peer)] = cells
    return {"runs": runs, "frameworks": frameworks, "per": per, "ratios": ratios}


def seeds_tables(summary: dict, labels: list[str]) -> str:
    """Three markdown tables of `seeds_summary`: time to the target per run, each framework over the runs,
    and the peers' times over ours."""
    fws, runs = summary["frameworks"], summary["runs"]
    mean = statistics.fmean
    lines = ["| run | target | " + " | ".join(fws) + " |", "|" + "---|" * (len(fws) + 2)]
    for label, run in zip(labels, runs, strict=True):
        cells = []
        for f in fws:
            e = run["hit"].get(f)
            if f not in run["last_s"]:
                cells.append("")
            elif e is None:
                cells.append(f"not reached (> {run['last_s'][f]:.1f})")
            else:
                cells.append(f"{e['elapsed_s']:.1f} (step {e['step']})")
        lines.append(f"| {label} | {run['target']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| framework | final acc per run (mean) | mean of evaluations after step 0 "
              "| s/step (steady) median (range) | trained tok/s (mean) | process s (mean) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for f in fws:
        p = summary["per"][f]
        steady = sorted(p["steady"])
        cols = [f"{f} {p['version']}".strip(),
                " / ".join(f"{a:.3f}" for a in p["finals"]) + f" ({mean(p['finals']):.3f})",
                f"{p['mean_eval']:.3f}" if p["mean_eval"] is not None else "",
                f"{statistics.median(steady):.2f} ({steady[0]:.2f}-{steady[-1]:.2f})" if steady else "",
                f"{mean(p['tok_s']):,.0f}" if p["tok_s"] else "",
                f"{mean(p['process_s']):.0f}" if p["process_s"] else ""]  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    if summary["ratios"]:
        lines += ["", "| peer's time to the target / ours | " + " | ".join(labels) + " |",
                  "|" + "---|" * (len(labels) + 1)]  # fmt: skip
        for (ours, peer), cells in summary["ratios"].items():
            text = ["not reached by ours" if c is None else f"{c[0]}{c[1]:.2f}x" for c in cells]
            lines.append(f"| {peer} / {ours} | " + " | ".join(text) + " |")
    return "\n".join(lines)
