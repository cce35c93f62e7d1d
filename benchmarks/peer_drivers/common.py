"""What every peer driver shares: the spec, the prompts, the reward, the learning-rate schedule, the clock.

Runs in a peer's own venv (copied beside the driver by benchmarks/bench_peers.py): standard library only.
"""

from __future__ import annotations

import json
import math
import sys
import time


def load_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def reward(kind: str, completion: str, answer: str) -> float:
    """The task's verifier, as jaxrl_async.rewards.synthetic defines it (arithmetic and letter_range: the
    exact stripped answer; shift: the share of answer positions right)."""
    got = completion.strip()
    if kind in ("arithmetic", "letter_range"):
        return 1.0 if got == answer else 0.0
    if kind == "shift":
        return sum(a == b for a, b in zip(answer, got, strict=False)) / max(len(answer), len(got), 1)
    raise ValueError(f"spec.reward: unknown reward {kind!r}")


def with_stop_token(completions: list, max_new: int, eos_id: int) -> list[list[int]]:
    """Sampled completions with their stop token put back: a sampler that cuts each completion before
    its first stop token (Tunix's) leaves the stop out of the loss, so no sample is rewarded for stopping
    where it did. A completion shorter than the new-token limit ended on the stop; one at the limit was
    cut there and gets none."""
    return [[*map(int, c), eos_id] if len(c) < max_new else [*map(int, c)] for c in completions]


def lr_at(spec: dict, step: int) -> float:
    """The rate of train step `step` (0-based): linear warmup from 0, then cosine to lr * end_lr_ratio at
    schedule_steps (optax.warmup_cosine_decay_schedule, as jaxrl_async.trainer.optimizer builds it)."""
    peak, warm, total = spec["lr"], spec["warmup_steps"], spec["schedule_steps"]
    end = peak * spec["end_lr_ratio"]
    if warm and step < warm:
        return peak * step / warm
    t = min(max(step - warm, 0), total - warm) / max(total - warm, 1)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


def lr_factor(spec: dict, step: int) -> float:
    return lr_at(spec, step) / spec["lr"]


def batches(rows: list[dict], size: int, steps: int) -> list[list[dict]]:
    """The first `steps` batches of `size` rows, in file order (the order our run draws them)."""
    out = [rows[i * size : (i + 1) * size] for i in range(steps)]
    if any(len(b) < size for b in out):
        raise ValueError(f"train.jsonl holds {len(rows)} prompts, fewer than {steps} x {size}")
    return out


class Clock:
    """Training wall time with the driver's own evaluations taken out (they block its loop; ours run
    beside training), and the trained-token count (prompt + completion tokens of every sample)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.eval_s = 0.0
        self.trained_tokens = 0
        self.evals: list[dict] = []

    def restart(self) -> None:
        """Training starts now: what came before (loading, the step-0 evaluation) is not counted."""
        self.t0, self.eval_s = time.perf_counter(), 0.0

    def train_elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_s

    def evaluate(self, step: int, fn) -> float:
        t = time.perf_counter()
        acc = float(fn())
        self.eval_s += time.perf_counter() - t
        self.evals.append({"step": step, "accuracy": acc, "elapsed_s": self.train_elapsed(),
                           "eval_s": time.perf_counter() - t})  # fmt: skip
        print(f"step {step}: held-out accuracy {acc:.4f} ({self.train_elapsed():.1f} s trained)", flush=True)
        return acc


def write_result(path: str, framework: str, version: str, clock: Clock, patches: list[str], **extra) -> None:
    out = {"framework": framework, "version": version, "patches": patches, "evals": clock.evals,
           "trained_tokens": clock.trained_tokens, "train_s": clock.train_elapsed(),
           "eval_s": clock.eval_s, "python": sys.version.split()[0], **extra}  # fmt: skip
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
