"""Benchmark the reward service: graded completions per second with 1, 2 and N (= cores) workers.

  python tools/bench_rewards.py                      # arithmetic, math, code; prints JSON + a table
  python tools/bench_rewards.py --kinds code --n 64  # one kind, more items
  python tools/bench_rewards.py --hostile            # also print the sandbox containment table

"inline" grades the same items sequentially in this process (no pool), as a baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_async.rewards import RewardConfig, RewardService, grade_one, hostile, sandbox  # noqa: E402  # noqa: E402

_MATH_FORMS = [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is $\\frac{3}{4}$", "0.75"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("so #### 72", "71"),
]


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
        else:
            raise ValueError(f"unknown kind {kind!r}")
    return items


def time_pool(kind: str, items, workers: int) -> float:
    """Completions per second of one grade_batch over `items` (workers started beforehand)."""
    with RewardService(RewardConfig(reward=kind, num_workers=workers, timeout_s=60.0)) as svc:
        svc.wait_ready()
        svc.grade_batch(items[: 2 * workers])  # warm the workers' lazy imports
        t0 = time.perf_counter()
        svc.grade_batch(items)
        return len(items) / (time.perf_counter() - t0)


def time_inline(kind: str, items) -> float:
    cfg = RewardConfig(reward=kind)
    grade_one(cfg, *items[0])
    t0 = time.perf_counter()
    for item in items:
        grade_one(cfg, *item)
    return len(items) / (time.perf_counter() - t0)


def bench(kinds, n_items: dict[str, int], worker_counts, repeats: int) -> list[dict]:
    rows = []
    for kind in kinds:
        items = make_items(kind, n_items[kind])
        runs = {"inline": [time_inline(kind, items) for _ in range(repeats)]}
        for w in worker_counts:
            runs[str(w)] = [time_pool(kind, items, w) for _ in range(repeats)]
        base = statistics.median(runs["1"]) if "1" in runs else None
        for name, vals in runs.items():
            med = statistics.median(vals)
            rows.append(
                {
                    "kind": kind,
                    "workers": name,
                    "items": len(items),
                    "per_s_median": round(med, 1),
                    "per_s_runs": [round(v, 1) for v in vals],
                    "vs_1_worker": round(med / base, 2) if base else None,
                }
            )
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
            rows.append(
                {
                    "case": case.name,
                    "status": res.status,
                    "elapsed_s": round(res.elapsed_s, 2),
                    "evidence": evidence,
                    "contained": not breached and status in case.expected,
                }
            )
    finally:
        listener.close()
        del os.environ[hostile.SECRET_ENV]
    return rows


def _markdown(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="arithmetic,math,code")
    ap.add_argument("--n", type=int, default=0, help="items per kind (default: 2000 / 400 / 60)")
    ap.add_argument("--workers", default="", help="comma list (default: 1,2,N with N = os.cpu_count())")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hostile", action="store_true", help="also print the sandbox containment table")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    counts = [int(w) for w in args.workers.split(",")] if args.workers else sorted({1, 2, cores})
    defaults = {"arithmetic": 2000, "math": 400, "code": 60}
    kinds = args.kinds.split(",")
    n_items = {k: args.n or defaults[k] for k in kinds}
    rows = bench(kinds, n_items, counts, args.repeats)
    report = {"cores": cores, "sandbox": sandbox.capabilities().describe(), "throughput": rows}
    if args.hostile:
        report["hostile"] = hostile_table()
    print(json.dumps(report))
    print()
    print(_markdown(rows, ["kind", "workers", "items", "per_s_median", "vs_1_worker", "per_s_runs"]))
    if args.hostile:
        print()
        print(_markdown(report["hostile"], ["case", "status", "elapsed_s", "evidence", "contained"]))


if __name__ == "__main__":
    main()
