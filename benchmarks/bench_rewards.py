"""Benchmark the reward service: graded completions per second with 1, 2 and N (= cores) workers.

  python -m benchmarks.bench_rewards                        # arithmetic, math, code kinds; JSON + a table
  python -m benchmarks.bench_rewards --kinds code --n 64    # one kind, more items
  python -m benchmarks.bench_rewards --kinds code,code_asserts,math --baseline 49934da
                                                       # this tree and another commit, side by side
  python -m benchmarks.bench_rewards --hostile              # containment table + reward-hacking table
  python -m benchmarks.bench_rewards --hostile --baseline 49934da   # ... with the rewards at that commit
  python -m benchmarks.bench_rewards --startup              # start-up cost of each sandbox layer (+ bwrap)

Kinds: arithmetic, math, code (stdin/stdout tests), code_asserts (`test_code`), code_cases (structured
`cases`; not graded by commits before the harness). "inline" grades the same items sequentially in this
process (no pool). With --baseline, each pool measurement runs in a fresh process for this tree and for
the commit's `jaxrl_async` (extracted with `git archive`), alternating which goes first per repeat.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from jaxrl_async.cli import run_command
from jaxrl_async.rewards import RewardConfig, RewardService, grade_one, sandbox
from jaxrl_async.rewards.sandbox import fsview, wire
from jaxrl_async.rewards.testing import hostile, reward_hacks

# The checkout: "this tree" of the comparisons, and the git repository --baseline reads.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout

_KINDS = flags.DEFINE_list("kinds", ["arithmetic", "math", "code"], "Reward kinds to measure (see above).")
_N = flags.DEFINE_integer("n", 0, "Items per kind (0: 2000 / 400 / 60 / 60 / 60).", lower_bound=0)
_WORKERS = flags.DEFINE_list("workers", [], "Pool sizes (default: 1,2,N with N = os.cpu_count()).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Measurements of each pool (medians are reported).", 1)
_BASELINE = flags.DEFINE_string("baseline", "", "git revision to measure side by side with this tree")
_HOSTILE = flags.DEFINE_bool("hostile", False, "Print the containment and reward-hacking tables.")
_STARTUP = flags.DEFINE_bool("startup", False, "Print the start-up cost of each sandbox layer.")
_NO_THROUGHPUT = flags.DEFINE_bool("no-throughput", False, "Skip the throughput measurement.")

_MATH_FORMS = [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is $\\frac{3}{4}$", "0.75"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("so #### 72", "71"),
]
_REWARD = {"code_asserts": "code", "code_cases": "code"}
_DEFAULT_N = {"arithmetic": 2000, "math": 400, "code": 60, "code_asserts": 60, "code_cases": 60}
# Measures one pool in a fresh process, with whichever `jaxrl_async` PYTHONPATH puts first.
_RUNNER = r"""
import json, sys, time
import jaxrl_async
from jaxrl_async.rewards import RewardConfig, RewardService
reward, workers, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
items = [tuple(x) for x in json.load(open(path))]
with RewardService(RewardConfig(reward=reward, num_workers=workers, timeout_s=60.0)) as svc:
    svc.wait_ready()
    if workers:
        svc.grade_batch(items[: 2 * workers])  # warm the workers' lazy imports
    t0 = time.perf_counter()
    results = svc.grade_batch_results(items)
    dt = time.perf_counter() - t0
print(json.dumps({"per_s": len(items) / dt, "rewards": [r.reward for r in results],
                  "package": jaxrl_async.__file__}))
"""


def make_items(kind: str, n: int) -> list[tuple[str, str, dict]]:
    """`n` (prompt, completion, metadata) items of one reward kind, half right and half wrong."""
    items = []
    for i in range(n):
        if kind == "arithmetic":
            a, b = i % 97, (i * 7) % 89
            items.append((f"{a}+{b}=", str(a + b + i % 2), {"answer": str(a + b)}))
        elif kind == "math":
            completion, answer = _MATH_FORMS[i % len(_MATH_FORMS)]
            items.append(("q", completion.replace("72", str(72 + i % 3)), {"answer": answer}))
        elif kind == "code":
            program = "n = int(input())\nprint(n * n)\n" if i % 2 else "print(input())\n"
            items.append(("p", program, {"tests": [{"input": str(i), "output": str(i * i)}]}))
        elif kind in ("code_asserts", "code_cases"):
            program = "def f(x):\n    return x * x\n" if i % 2 else "def f(x):\n    return x + x\n"
            xs = [i, i + 3, -i - 1]
            if kind == "code_asserts":
                meta = {"test_code": "".join(f"assert f({x}) == {x * x}\n" for x in xs)}
            else:
                meta = {"entry_point": "f", "cases": [{"args": [x], "expected": x * x} for x in xs]}
            items.append(("p", program, meta))
        else:
            raise ValueError(f"--kinds: unknown kind {kind!r}; known: {sorted(_DEFAULT_N)}")
    return items


def extract_tree(ref: str) -> tuple[str, str]:
    """(a temp dir holding `jaxrl_async` as of git commit `ref`, the commit's short hash)."""
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", ref], capture_output=True, text=True)
    if rev.returncode != 0:
        raise app.UsageError(f"--baseline: unknown git revision {ref!r}: {rev.stderr.strip()}")
    tree = tempfile.mkdtemp(prefix="jaxrl_baseline_")
    archive = subprocess.run(["git", "-C", REPO, "archive", ref, "jaxrl_async"], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    return tree, rev.stdout.strip()


def run_pool(tree: str, reward: str, items, workers: int) -> dict:
    """One grade_batch over `items` in a fresh process importing `jaxrl_async` from `tree`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(items, f)
        f.flush()
        env = {**os.environ, "PYTHONPATH": tree}
        # cwd = tree: `python -c` puts the cwd first on sys.path.
        out = subprocess.run([sys.executable, "-c", _RUNNER, reward, str(workers), f.name], env=env,
                             capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"pool run failed ({tree}): {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["package"].startswith(tree):
        raise RuntimeError(f"expected jaxrl_async from {tree}, got {res['package']}")
    return res


def time_inline(kind: str, items) -> float:
    cfg = RewardConfig(reward=_REWARD.get(kind, kind))
    grade_one(cfg, *items[0])
    t0 = time.perf_counter()
    for item in items:
        grade_one(cfg, *item)
    return len(items) / (time.perf_counter() - t0)


def bench(kinds, n_items, worker_counts, repeats: int, baseline: tuple[str, str] | None) -> list[dict]:
    """Throughput rows; with a baseline, a row per (kind, workers, tree) and the ratio new / baseline."""
    rows = []
    trees = {"this tree": REPO}
    if baseline:
        trees[baseline[1]] = baseline[0]
    for kind in kinds:
        items = make_items(kind, n_items[kind])
        reward = _REWARD.get(kind, kind)
        runs: dict[tuple[str, str], list[float]] = {("inline", "this tree"): []}
        means: dict[tuple[str, str], float] = {}
        for r in range(repeats):
            runs[("inline", "this tree")].append(time_inline(kind, items))
            for w in worker_counts:
                order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
                for name, tree in order:
                    if kind == "code_cases" and name != "this tree":
                        continue  # structured cases did not exist before the harness
                    res = run_pool(tree, reward, items, w)
                    runs.setdefault((str(w), name), []).append(res["per_s"])
                    means[(str(w), name)] = sum(res["rewards"]) / len(items)
        for (workers, name), vals in runs.items():
            med = statistics.median(vals)
            base = runs.get((workers, baseline[1])) if baseline and name == "this tree" else None
            rows.append({
                "kind": kind,
                "workers": workers,
                "tree": name,
                "items": len(items),
                "per_s_median": round(med, 1),
                "per_s_runs": [round(v, 1) for v in vals],
                "mean_reward": round(means.get((workers, name), float("nan")), 3),
                "vs_baseline": round(med / statistics.median(base), 3) if base else None,
            })
    return rows


def hostile_table() -> list[dict]:
    """Runs every hostile case directly in the sandbox (2 s limits) and reports what contained it."""
    limits = sandbox.SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, max_output_bytes=1 << 16)
    secret = "s3cr3t-" + os.urandom(4).hex()
    os.environ[hostile.SECRET_ENV] = secret
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    outside = tempfile.mkdtemp(prefix="jaxrl_outside_")
    escape = os.path.join(outside, "escaped.txt")
    rows = []
    try:
        for case in hostile.CASES:
            code = hostile.render(case, escape_path=escape, secret=secret, port=listener.getsockname()[1])
            res = sandbox.run_python(code, "", limits)
            breached = hostile.BREACH_MARKER in res.stdout or os.path.exists(escape)
            status = "wrong_output" if res.ok else res.status
            evidence = (res.stderr.strip().splitlines() or [""])[-1][:80]
            if res.status == "output_limit":
                evidence = f"stdout cut at {len(res.stdout)} bytes"
            rows.append({
                "case": case.name,
                "status": res.status,
                "elapsed_s": round(res.elapsed_s, 2),
                "evidence": evidence,
                "contained": not breached and status in case.expected,
            })
    finally:
        listener.close()
        del os.environ[hostile.SECRET_ENV]
        shutil.rmtree(outside, ignore_errors=True)
    return rows


def hack_table(baseline: tuple[str, str] | None) -> list[dict]:
    """Grades the reward-hack suite with this tree (and the baseline's rewards when given)."""
    limits = {"timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256, "max_output_bytes": 1 << 16}
    with reward_hacks.hack_environment() as values:
        items = []
        for case in reward_hacks.CASES:
            completion, metadata = reward_hacks.render(case, values)
            items.append(("p", completion, {**metadata, "reward": case.reward, "sandbox": limits}))
        cfg = RewardConfig(reward="code", num_workers=2, timeout_s=30.0)
        with RewardService(cfg) as svc:
            svc.wait_ready()
            results = svc.grade_batch_results(items, timeout=600)
        old = run_pool(baseline[0], "code", items, 2)["rewards"] if baseline else None
    rows = []
    for i, (case, res) in enumerate(zip(reward_hacks.CASES, results, strict=True)):
        row = {"kind": case.kind, "case": case.name, "expected": case.expected, "reward": res.reward}
        if old is not None:
            row[f"reward at {baseline[1]}"] = old[i]
        row["ok"] = res.reward == case.expected
        row["info"] = res.info.replace("|", "/")[:90]
        rows.append(row)
    return rows


def hack_summary(rows: list[dict]) -> list[dict]:
    """Per class: how many cases, how many get their expected reward (and, with a baseline, how many of
    the class's hacks scored 1.0 there)."""
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        group = [r for r in rows if r["kind"] == kind]
        row = {"class": kind, "cases": len(group), "expected reward": sum(r["ok"] for r in group)}
        for col in (c for c in group[0] if c.startswith("reward at")):
            row[f"scored 1.0 {col[len('reward '):]}"] = sum(r[col] == 1.0 for r in group)
        out.append(row)
    return out


def _bwrap_argv(plan: fsview.RootPlan, workdir: str) -> list[str]:
    """bubblewrap arguments building the same root as `fsview.enter`, plus a PID namespace."""
    argv = ["bwrap", "--unshare-net", "--unshare-pid", "--die-with-parent", "--new-session"]
    for d in plan.dirs:
        argv += ["--dir", d]
    for link, target in plan.symlinks:
        argv += ["--symlink", target, link]
    for path in plan.binds:
        argv += ["--ro-bind", path, path]
    argv += ["--dev", "/dev", "--proc", "/proc", "--bind", workdir, fsview.SANDBOX_DIR,
             "--chdir", fsview.SANDBOX_DIR, "--remount-ro", "/"]
    return argv + [plan.python, "-I", "-c", "pass"]


def startup_table(repeats: int, n: int) -> list[dict]:
    """Median seconds to launch `pass` per configuration, interleaved across configurations."""
    caps = sandbox.capabilities()
    python = sandbox.pick_python(caps, None)
    plan = fsview.plan_for(python, tuple(sorted(sandbox.SANDBOX_ENV.items())))
    none = sandbox.Capabilities(uid=caps.uid, netns=False, fsview=False, mountns=False)
    limits = sandbox.SandboxLimits()
    job = wire.make_job({"mode": "test_code", "test_code": "assert f() == 1"})[0]
    workdir = tempfile.mkdtemp(prefix="jaxrl_bwrap_")

    def run_bwrap():
        out = subprocess.run(_bwrap_argv(plan, workdir), capture_output=True)
        if out.returncode != 0:
            raise RuntimeError(f"bwrap failed: {out.stderr.decode()[-300:]}")

    def layers(**on):  # `pass` under rlimits and a uid of its own, plus the layers named
        return sandbox.run_raw("pass", limits, dataclasses.replace(none, **on), python)

    configs = {
        "bare interpreter (no sandbox)": lambda: subprocess.run([python, "-I", "-c", "pass"], check=True),
        "rlimits + uid": lambda: layers(),
        "+ netns": lambda: layers(netns=True),
        "+ netns + mountns (read-only host, old view)": lambda: layers(netns=True, mountns=True),
        "+ netns + fsview (minimal root, hidepid /proc)": lambda: layers(netns=True, fsview=True),
        "harness (judge + program), all layers":
            lambda: sandbox.run_raw("def f():\n    return 1\n", limits, caps, python, job=job),
    }
    if shutil.which("bwrap"):
        configs["bwrap (same root, PID namespace, no uid drop)"] = run_bwrap
    times: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for _ in range(repeats):
            for name, fn in configs.items():
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = statistics.median(times["bare interpreter (no sandbox)"])
    return [{"config": name, "median_ms": round(1000 * statistics.median(v), 2),
             "over_bare_ms": round(1000 * (statistics.median(v) - base), 2), "runs": len(v)}
            for name, v in times.items()]


def _markdown(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    cores = os.cpu_count() or 1
    try:
        counts = [int(w) for w in _WORKERS.value] if _WORKERS.value else sorted({1, 2, cores})
    except ValueError:
        raise app.UsageError(f"--workers: {','.join(_WORKERS.value)} is not a list of integers") from None
    kinds = _KINDS.value
    unknown = set(kinds) - set(_DEFAULT_N)
    if unknown:
        raise app.UsageError(f"--kinds: unknown {sorted(unknown)}; known: {sorted(_DEFAULT_N)}")
    baseline = extract_tree(_BASELINE.value) if _BASELINE.value else None
    try:
        report = {"cores": cores, "sandbox": sandbox.capabilities().describe()}
        if not _NO_THROUGHPUT.value:
            n_items = {k: _N.value or _DEFAULT_N[k] for k in kinds}
            report["throughput"] = bench(kinds, n_items, counts, _REPEATS.value, baseline)
        if _HOSTILE.value:
            report["hostile"] = hostile_table()
            report["reward_hacks"] = hack_table(baseline)
        if _STARTUP.value:
            report["startup"] = startup_table(_REPEATS.value, 10)
    finally:
        if baseline:
            shutil.rmtree(baseline[0], ignore_errors=True)
    print(json.dumps(report))
    if "throughput" in report:
        cols = ["kind", "workers", "tree", "items", "per_s_median", "vs_baseline", "mean_reward",
                "per_s_runs"]
        print("\n" + _markdown(report["throughput"], cols))
    if _HOSTILE.value:
        print("\n" + _markdown(report["hostile"], ["case", "status", "elapsed_s", "evidence", "contained"]))
        hack_cols = ["kind", "case", "expected", "reward"] + [c for c in report["reward_hacks"][0]
                                                              if c.startswith("reward at")] + ["ok", "info"]
        print("\n" + _markdown(report["reward_hacks"], hack_cols))
        summary = hack_summary(report["reward_hacks"])
        print("\n" + _markdown(summary, list(summary[0])))
    if _STARTUP.value:
        print("\n" + _markdown(report["startup"], ["config", "median_ms", "over_bare_ms", "runs"]))


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m benchmarks.bench_rewards`
    run()
