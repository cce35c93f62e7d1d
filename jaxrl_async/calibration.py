"""Each role of a run measured alone, with the run's own devices, model, data and rewards.

Inputs of the shared-host performance model (`jaxrl_async.perf.shared_host`): how long the sampler takes
to produce one train batch (from empty slots to the last graded sample, as sync RL does, and at the
steady rate of a never-drained stream, as async RL does), how long one train step plus its weight sync
takes, and how much of the host's cores each keeps busy meanwhile (process CPU seconds, which include
XLA's worker threads). Part of the orchestrator layer: it drives the same sampler loop, reward service
and train step as a run (`tools/bench_roles.py` is the CLI).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from typing import Any

from jaxrl_async.data import make_prompt_iterator
from jaxrl_async.orchestrator import to_rollout, train_on
from jaxrl_async.rollouts import Rollout
from jaxrl_async.sampler import Request, SamplerLoop
from jaxrl_async.setup import Setup


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Sampling:
    """Admits prompts from the run's data stream, samples them and grades them, like the orchestrator."""

    def __init__(self, setup: Setup):
        self.s = setup
        self.run = setup.run
        self.loop = SamplerLoop(setup.engine)
        self.prompts = make_prompt_iterator(self.run.data, setup.tokenizer)
        self.next_gid = 0
        self.budget = 0  # prompts still allowed to start
        self.pending: dict[tuple[int, int], Any] = {}
        self.groups: dict[int, list[Rollout]] = defaultdict(list)
        self.graded = 0

    def _admit(self) -> Request | None:
        if self.budget <= 0:
            return None
        prompt = next(self.prompts, None)
        if prompt is None:
            raise RuntimeError("the data stream ended during calibration; use more epochs")
        self.budget -= 1
        self.next_gid += 1
        return Request(
            uid=self.next_gid,
            prompt_tokens=tuple(int(t) for t in prompt.tokens),
            n_samples=self.run.samples_per_prompt,
            seed=self.run.seed * 1_000_003 + self.next_gid,
            metadata=prompt,
        )

    def step(self) -> None:
        tok = self.s.tokenizer
        for c in self.loop.step(self._admit):
            key = (int(c.uid), int(c.sample_index))
            self.pending[key] = c
            self.s.rewards.submit(key, c.metadata.text, tok.decode(c.tokens), dict(c.metadata.metadata))
        if self.loop.idle and self.pending:
            self.s.rewards.wait(0.01)
        for res in self.s.rewards.poll():
            c = self.pending.pop(res.request_id)
            self.groups[int(c.uid)].append(to_rollout(c, res.reward, res.reason, tok))
            self.graded += 1

    def until_graded(self, count: int) -> None:
        while self.graded < count:
            self.step()

    def take_batches(self) -> list[list[list[Rollout]]]:
        """Complete groups so far, in admission order, cut into train batches (leftovers dropped)."""
        g = self.run.samples_per_prompt
        done = [self.groups.pop(k) for k in sorted(self.groups) if len(self.groups[k]) == g]
        b = self.run.prompts_per_step
        return [done[i : i + b] for i in range(0, len(done) - b + 1, b)]


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def calibrate_roles(setup: Setup, batches: int = 6) -> dict[str, Any]:
    """Measures the sampler and the trainer of `setup`, one at a time (nothing else runs).

    Args:
      setup: a built run (`jaxrl_async.setup.build_setup`); its train state is updated by the timed steps.
      batches: timed train batches per measurement (one more, untimed, compiles first).

    Returns:
      A dict (the role-bench JSON of `jaxrl_async.perf.shared_host.RoleBench`) with per-batch medians:
      `sample_batch_s` / `sample_batch_cpu_s` (one batch from empty slots to its last graded sample),
      `sample_stream_s` / `sample_stream_cpu_s` (seconds per batch of samples while admission never
      stops), `train_step_s` / `train_step_cpu_s` (prepare + train step + reshard onto the sampler mesh),
      `update_s` (the sampler swapping in new weights), batch sizes, lengths and the host's core count.
    """
    if batches < 2:
        raise ValueError(f"batches must be >= 2, got {batches}")
    run = setup.run
    n = run.prompts_per_step * run.samples_per_prompt
    smp = _Sampling(setup)
    setup.rewards.wait_ready()

    # Sync-style: one batch at a time, from empty slots to the last graded sample.
    batch_times = []
    for i in range(batches + 1):
        smp.budget = run.prompts_per_step
        t = _timed(lambda i=i: smp.until_graded((i + 1) * n))
        if i:  # the first batch compiles
            batch_times.append(t)
    # Async-style: admission never stops; time `batches` batches' worth after one batch of fill-up.
    smp.budget = 10**9
    start = smp.graded
    smp.until_graded(start + n)
    stream = _timed(lambda: smp.until_graded(start + (batches + 1) * n))
    smp.budget = 0
    while not smp.loop.idle or smp.pending:
        smp.step()

    train_batches = smp.take_batches()
    lengths = [len(r.completion_tokens) for b in train_batches for g in b for r in g]
    tokens = [
        sum(len(r.prompt_tokens) + len(r.completion_tokens) for g in b for r in g) for b in train_batches
    ]
    train_times, update_times = [], []
    for i, groups in enumerate(train_batches[: batches + 1]):
        out = []
        t = _timed(lambda groups=groups, out=out: out.append(train_on(setup, groups)))
        r = out[0]
        u = _timed(lambda r=r: smp.loop.update_params(r.sampler_params, r.version, run.sampler.update_mode))
        if i:
            train_times.append(t)
            update_times.append(u[0])
    med = lambda xs: float(statistics.median(xs))
    return {
        "sampler_devices": run.mesh.sampler_devices,
        "trainer_devices": run.mesh.trainer_devices,
        "colocated": bool(run.mesh.colocate),
        "cores": host_cores(),
        "num_slots": run.sampler.num_slots,
        "samples_per_batch": n,
        "max_staleness": run.eta,
        "tokens_per_batch": med(tokens),
        "completion_length_mean": float(statistics.fmean(lengths)),
        "sample_batch_s": med([w for w, _ in batch_times]),
        "sample_batch_cpu_s": med([c for _, c in batch_times]),
        "sample_stream_s": stream[0] / batches,
        "sample_stream_cpu_s": stream[1] / batches,
        "train_step_s": med([w for w, _ in train_times]),
        "train_step_cpu_s": med([c for _, c in train_times]),
        "update_s": med(update_times),
        "batches": batches,
    }
