"""The orchestrator: the only module that knows every part.

Data flows one way: prompts -> sampler -> reward service -> rollout queue -> trainer -> weight sync ->
sampler. The main thread runs the sampler's event loop (admission under the staleness bound, decode,
grading); a trainer thread runs train steps and reshards each new policy onto the sampler mesh, which the
main thread swaps in between decode calls (in flight). `mode="sync"` is the same code with eta = 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_async.data import held_out_prompts, make_prompt_iterator
from jaxrl_async.evaluation import evaluate_accuracy
from jaxrl_async.metrics import MetricsWriter, summary_line
from jaxrl_async.rollouts import Rollout, RolloutQueue, StalenessController, staleness_stats
from jaxrl_async.sampler import Request, SamplerLoop
from jaxrl_async.setup import Setup, build_setup, resume
from jaxrl_async.trainer import prepare_batch, train_step

log = logging.getLogger(__name__)

SUMMARY_KEYS = (
    "reward/mean",
    "eval/accuracy",
    "loss/policy",
    "staleness/mean",
    "staleness/max",
    "staleness/token_mean",
    "perf/train_tokens_per_s",
    "perf/weight_sync_s",
)


@dataclasses.dataclass
class TrainResult:
    """What the trainer thread hands back after one step."""

    version: int
    sampler_params: Any
    metrics: dict[str, float]
    groups: list[list[Rollout]]
    trained_tokens: int
    step_seconds: float
    sync_seconds: float


class TrainerWorker:
    """Runs train steps on the trainer submesh in its own thread and reshards each new policy."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.inbox: queue.Queue = queue.Queue(maxsize=1)
        self.outbox: queue.Queue = queue.Queue()
        self.busy = False
        self.idle_seconds = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)
        self._thread.start()

    def submit(self, groups: list[list[Rollout]], trainer_version: int) -> None:
        self.busy = True
        self.inbox.put((groups, trainer_version))

    def close(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=600)

    def _run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                item = self.inbox.get()
                self.idle_seconds += time.perf_counter() - t0
                if item is None:
                    return
                self.outbox.put(self._step(*item))
        except BaseException as e:  # surfaced to the main thread, which stops the run
            self.error = e
            self.outbox.put(None)

    def _step(self, groups: list[list[Rollout]], trainer_version: int) -> TrainResult:
        return train_on(self.setup, groups)


def train_on(s: Setup, groups: list[list[Rollout]]) -> TrainResult:
    """One train step on `groups` (updates `s.state`) and the new policy resharded onto the sampler mesh."""
    t0 = time.perf_counter()
    rollouts = [r for g in groups for r in g]
    batch = prepare_batch(s.run.trainer, rollouts)
    s.state, metrics = train_step(s.state, batch)
    metrics = {k: float(np.asarray(v)) for k, v in metrics.items() if np.ndim(v) == 0}
    metrics["zero_adv_skipped_frac"] = batch.num_skipped / max(len(rollouts), 1)
    version = int(s.state.version)
    step_s = time.perf_counter() - t0
    sampler_params = s.weight_sync(s.state.params)
    # Tokens consumed by the step, including sequences skipped for a zero advantage.
    tokens = sum(len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts)
    return TrainResult(version, sampler_params, metrics, groups, tokens, step_s, s.weight_sync.last_seconds)


def to_rollout(c, reward: float, reason: str, tokenizer) -> Rollout:
    """A graded sampler Completion (its metadata is the Prompt) as a trainer Rollout."""
    return Rollout(
        uid=c.metadata.uid,
        group_id=int(c.uid),
        sample_index=int(c.sample_index),
        prompt_tokens=np.asarray(c.prompt_tokens, np.int32),
        completion_tokens=np.asarray(c.tokens, np.int32),
        behav_logprobs=np.asarray(c.logprobs, np.float32),
        versions=np.asarray(c.versions, np.int32),
        reward=float(reward),
        finish_reason=c.finish_reason,
        metadata={"text": tokenizer.decode(c.tokens), "prompt": c.metadata.text, "reason": reason},
    )


class Orchestrator:
    """Drives one run; `run()` returns a summary dict (also written to workdir/summary.json).

    Args:
      setup: the built parts (see jaxrl_async.setup.build_setup).
      max_new_tokens_fn: optional prompt index -> generation cap (benchmarks impose a length distribution).
    """

    def __init__(self, setup: Setup, max_new_tokens_fn: Callable[[int], int] | None = None):
        self.s = setup
        self.max_new_tokens_fn = max_new_tokens_fn
        run = setup.run
        self.run_cfg = run
        self.controller = StalenessController(run.prompts_per_step, run.eta)
        self.queue = RolloutQueue(run.samples_per_prompt, run.max_head_staleness)
        self.train_iter = make_prompt_iterator(
            run.data, setup.tokenizer, process_index=jax.process_index(), process_count=jax.process_count()
        )
        self.eval_prompts = held_out_prompts(run.data, setup.tokenizer, run.eval_prompts)
        self.sampler = SamplerLoop(setup.engine)
        self.writer = MetricsWriter(run.workdir, enabled=jax.process_index() == 0)
        self.version = resume(setup, self.train_iter)  # the sampler's policy version (= train steps done)
        # Prompts admitted before a restart were lost with their samples: count them as started.
        self.controller.started = self.version * run.prompts_per_step
        self.data_exhausted = False
        self.max_ahead = 0  # most versions admission ever ran ahead of the trainer (<= eta by construction)
        self._pending: dict[tuple[int, int], Any] = {}  # reward request id -> Completion
        self._metrics_hist: list[dict[str, float]] = []
        self._sampler_idle_s = 0.0
        self._sample_tokens = 0
        self._trained_tokens = 0

    # ----- admission and sampling -----

    def _admit(self) -> Request | None:
        if self.data_exhausted or not self.controller.can_admit(self.version):
            return None
        prompt = next(self.train_iter, None)
        if prompt is None:
            self.data_exhausted = True
            return None
        gid = self.controller.admit(self.version)
        self.max_ahead = max(self.max_ahead, self.controller.ahead(self.version))
        return Request(
            uid=gid,
            prompt_tokens=tuple(int(t) for t in prompt.tokens),
            n_samples=self.run_cfg.samples_per_prompt,
            seed=self.run_cfg.seed * 1_000_003 + gid,
            max_new_tokens=self.max_new_tokens_fn(gid) if self.max_new_tokens_fn else None,
            metadata=prompt,
        )

    def _grade(self, completions) -> None:
        tok = self.s.tokenizer
        for c in completions:
            self._sample_tokens += len(c.tokens)
            key = (int(c.uid), int(c.sample_index))
            self._pending[key] = c
            prompt = c.metadata
            self.s.rewards.submit(key, prompt.text, tok.decode(c.tokens), dict(prompt.metadata))

    def _collect_rewards(self) -> None:
        for res in self.s.rewards.poll():
            c = self._pending.pop(res.request_id)
            self.queue.add(to_rollout(c, res.reward, res.reason, self.s.tokenizer))

    # ----- evaluation -----

    def evaluate(self, sampler_params=None) -> float:
        """Greedy pass@1 on the held-out prompts with the sampler's current (or given) weights."""
        s = self.s
        return evaluate_accuracy(
            s.eval_engine,
            s.rewards,
            s.tokenizer,
            self.eval_prompts,
            sampler_params or s.engine_params(),
            self.version,
        )

    # ----- the loop -----

    def run(self) -> dict[str, Any]:
        run, s = self.run_cfg, self.s
        trainer = TrainerWorker(s)
        t_start = time.perf_counter()
        evals = [(self.version, self.evaluate(), 0.0)]
        self.writer.scalars(self.version, {"eval/accuracy": evals[0][1]})
        log.info("start: held-out accuracy %.3f (mode=%s, eta=%d)", evals[0][1], run.mode, run.eta)
        eval_seconds = 0.0
        progress = s.progress(run.total_steps, "train steps")
        try:
            while self.version < run.total_steps:
                if trainer.error is not None:
                    raise RuntimeError("trainer thread failed") from trainer.error
                did_work = self._sampler_round()
                if not did_work and self._pending:  # only rewards in flight: sleep until one lands
                    t0 = time.perf_counter()
                    self.s.rewards.wait(0.01)
                    self._sampler_idle_s += time.perf_counter() - t0
                    did_work = True
                if not trainer.busy:
                    groups = self.queue.pop_batch(run.prompts_per_step, self.version)
                    if groups is not None:
                        trainer.submit(groups, self.version)
                        did_work = True
                result = self._poll_trainer(trainer, block=not did_work)
                if result is None:
                    if self.data_exhausted and self.sampler.idle and not self._pending and not trainer.busy:
                        log.warning("data exhausted after %d steps", self.version)
                        break
                    continue
                trainer.busy = False
                self._apply_update(result)
                elapsed = time.perf_counter() - t_start - eval_seconds
                values = self._log_step(result, trainer, elapsed)
                if run.eval_every and self.version % run.eval_every == 0 or self.version == run.total_steps:
                    t0 = time.perf_counter()
                    acc = self.evaluate()
                    eval_seconds += time.perf_counter() - t0
                    evals.append((self.version, acc, elapsed))
                    values["eval/accuracy"] = acc
                    self.writer.scalars(self.version, {"eval/accuracy": acc})
                progress.update(1)
                if self.version % run.log_every == 0:
                    log.info(summary_line(self.version, values, SUMMARY_KEYS))
                if run.checkpoint_every and self.version % run.checkpoint_every == 0:
                    s.save_checkpoint(self.version, self.train_iter)
        finally:
            progress.close()
            trainer.close()
            self.writer.close()
        wall = time.perf_counter() - t_start
        s.save_checkpoint(self.version, self.train_iter)
        return self._summary(wall, eval_seconds, evals, trainer)

    def _sampler_round(self) -> bool:
        """One sampler step plus grading; False if the sampler had nothing to do (idle time is counted)."""
        t0 = time.perf_counter()
        completions = self.sampler.step(self._admit)
        active = bool(completions) or not self.sampler.idle
        self._grade(completions)
        self._collect_rewards()
        if not active:
            self._sampler_idle_s += time.perf_counter() - t0
        return active

    def _poll_trainer(self, trainer: TrainerWorker, block: bool) -> TrainResult | None:
        t0 = time.perf_counter()
        try:
            result = trainer.outbox.get(timeout=0.01) if block else trainer.outbox.get_nowait()
        except queue.Empty:
            result = None
        if block:
            self._sampler_idle_s += time.perf_counter() - t0
        if result is None and trainer.error is not None:
            raise RuntimeError("trainer thread failed") from trainer.error
        return result

    def _apply_update(self, result: TrainResult) -> None:
        self.sampler.update_params(result.sampler_params, result.version, self.run_cfg.sampler.update_mode)
        self.s.set_engine_params(result.sampler_params)
        self.version = result.version
        self._trained_tokens += result.trained_tokens

    def _log_step(self, result: TrainResult, trainer: TrainerWorker, elapsed: float) -> dict[str, float]:
        trained_version = result.version - 1  # the policy the batch was trained against
        st = staleness_stats(result.groups, trained_version)
        rewards = [r.reward for g in result.groups for r in g]
        lengths = [len(r.completion_tokens) for g in result.groups for r in g]
        m = result.metrics
        values = {
            "reward/mean": float(np.mean(rewards)),
            "loss/policy": m.get("loss"),
            "is_weight/mean": m.get("is_weight_mean"),
            "is_weight/max": m.get("is_weight_max"),
            "train/clip_frac": m.get("clip_frac"),
            "train/grad_norm": m.get("grad_norm"),
            "train/entropy": m.get("entropy_mean"),
            "train/skipped_updates": float(np.asarray(self.s.state.skipped)),
            "train/zero_adv_skipped_frac": m.get("zero_adv_skipped_frac"),
            "staleness/mean": st["head_mean"],
            "staleness/max": float(st["head_max"]),
            "staleness/token_mean": st["token_mean"],
            "staleness/token_max": float(st["token_max"]),
            "staleness/dropped_groups": float(self.queue.dropped_groups),
            "completion/length_mean": float(np.mean(lengths)),
            "completion/length_max": float(np.max(lengths)),
            "perf/train_tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
            "perf/sample_tokens_per_s": self._sample_tokens / max(elapsed, 1e-9),
            "perf/sampler_idle_frac": self._sampler_idle_s / max(elapsed, 1e-9),
            "perf/trainer_idle_frac": trainer.idle_seconds / max(elapsed, 1e-9),
            "perf/slot_occupancy": self.sampler.stats.occupancy,
            "perf/weight_sync_s": result.sync_seconds,
            "perf/train_step_s": result.step_seconds,
            "rewards/errors": float(sum(self.s.rewards.stats()["errors"].values())),
        }
        self.writer.scalars(self.version, values)
        self.writer.histogram(self.version, "staleness/head", st["head_values"])
        self.writer.histogram(self.version, "staleness/token", st["token_values"])
        self.writer.histogram(self.version, "completion/length", lengths)
        for r in [r for g in result.groups for r in g][: self.run_cfg.text_samples]:
            self.writer.text(
                self.version,
                "samples",
                f"reward {r.reward:.2f} | {r.metadata['prompt']!r} -> {r.metadata['text']!r}",
            )
        values["time/elapsed_s"] = elapsed
        values["time/trained_tokens"] = float(self._trained_tokens)
        self._metrics_hist.append({k: v for k, v in values.items() if v is not None})
        return values

    def _summary(self, wall: float, eval_seconds: float, evals, trainer: TrainerWorker) -> dict[str, Any]:
        hist = self._metrics_hist
        mean = lambda k: float(np.mean([h[k] for h in hist if k in h])) if hist else 0.0
        train_wall = max(wall - eval_seconds, 1e-9)
        summary = {
            "mode": self.run_cfg.mode,
            "max_staleness": self.run_cfg.eta,
            "loss": self.run_cfg.trainer.loss,
            "steps": self.version,
            "wall_s": wall,
            "eval_s": eval_seconds,
            "train_tokens_per_s": self._trained_tokens / train_wall,
            "steady_train_tokens_per_s": _steady_rate(hist),
            "sample_tokens_per_s": self._sample_tokens / train_wall,
            "sampler_idle_frac": self._sampler_idle_s / train_wall,
            "trainer_idle_frac": trainer.idle_seconds / train_wall,
            "staleness_mean": mean("staleness/mean"),
            "staleness_max": max((h.get("staleness/max", 0) for h in hist), default=0),
            "token_staleness_mean": mean("staleness/token_mean"),
            "weight_sync_s_mean": mean("perf/weight_sync_s"),
            "max_admission_ahead": self.max_ahead,
            "dropped_groups": self.queue.dropped_groups,
            "dropped_lengths": self.queue.dropped_lengths,
            "evals": [{"step": s, "accuracy": a, "elapsed_s": e} for s, a, e in evals],
            "final_accuracy": evals[-1][1],
            "initial_accuracy": evals[0][1],
            "warm_start": self.s.warm_start_info,
            "reward_stats": self.s.rewards.stats(),
        }
        if jax.process_index() == 0:
            os.makedirs(self.run_cfg.workdir, exist_ok=True)
            with open(os.path.join(self.run_cfg.workdir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2, default=str)
        return summary


def _steady_rate(hist: list[dict[str, float]]) -> float:
    """Trained tokens/s after the first fifth of the steps (at least 2): excludes compilation and fill-up."""
    k = max(2, len(hist) // 5)
    if len(hist) <= k:
        return 0.0
    a, b = hist[k - 1], hist[-1]
    return (b["time/trained_tokens"] - a["time/trained_tokens"]) / max(
        b["time/elapsed_s"] - a["time/elapsed_s"], 1e-9
    )


def run_from_config(config) -> dict[str, Any]:
    """Validates `config`, builds every part and runs; the entry point of launch/run.py."""
    setup = build_setup(config)
    try:
        return Orchestrator(setup).run()
    finally:
        setup.close()
