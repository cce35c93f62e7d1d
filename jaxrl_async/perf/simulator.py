"""Discrete-event simulator of asynchronous RL: continuous-batching sampler replicas, a FIFO queue of
finished groups, a trainer, in-flight weight updates and AReaL's staleness admission rule.

Events are chunks of decode steps: a replica runs k steps at a constant decode batch until its next
sample finishes or the step in flight when the trainer publishes a new version ends, so the cost is
per finished sample, not per decode step. Sync RL is the same system with η = 0 on all devices (the
sampler and the trainer then alternate by construction).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import numpy as np

from jaxrl_async.perf.system import System


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Measured over the train steps after warm-up.

    Attributes:
      tokens_per_s: response tokens consumed by the trainer per second.
      samples_per_s: samples consumed per second.
      step_period_s: mean time between train-step completions (a version every period).
      max_staleness: max head staleness (trainer version - version at the sample's first token).
      mean_staleness: mean head staleness over samples.
      mean_token_staleness: mean over tokens of (trainer version - version that generated the token).
      trainer_busy: fraction of time the trainer was computing.
      sampler_occupancy: mean fraction of decode slots in use while decoding.
      steps: train steps measured.
    """

    tokens_per_s: float
    samples_per_s: float
    step_period_s: float
    max_staleness: int
    mean_staleness: float
    mean_token_staleness: float
    trainer_busy: float
    sampler_occupancy: float
    steps: int


class _Replica:
    __slots__ = ("active", "chunk_start", "dt", "k", "end", "seq", "version", "busy")

    def __init__(self):
        self.active: list[int] = []
        self.chunk_start = 0.0  # when the chunk's first decode step starts (after stalls)
        self.dt = 0.0
        self.k = 0
        self.end = 0.0
        self.seq = 0
        self.version = 0  # policy version loaded
        self.busy = False


class _Sim:
    """State and event handlers; `run` drives the heap until enough train steps finished."""

    def __init__(self, system: System, sampler_devices: int, trainer_devices: int, max_staleness: int,
                 seed: int):
        self.sys = system
        self.wl = system.workload
        self.sp = system.sampler
        self.max_staleness = max_staleness
        self.trainer_devices = trainer_devices
        self.n_rep = system.replicas(sampler_devices)
        if self.n_rep < 1 or trainer_devices < 1:
            raise ValueError("simulate needs at least one sampler replica and one trainer device")
        self.rng = np.random.default_rng(seed)
        self.reps = [_Replica() for _ in range(self.n_rep)]
        cap = 1 << 12
        self.length = np.zeros(cap, np.int64)
        self.remaining = np.zeros(cap, np.int64)
        self.start_version = np.zeros(cap, np.int64)
        self.vsum = np.zeros(cap, np.float64)  # sum over generated tokens of their policy version
        self.n_samples = 0
        self.n_active = 0
        self.group_left: dict[int, int] = {}
        self.group_members: dict[int, list[int]] = {}
        self.pending: collections.deque[int] = collections.deque()
        self.done_groups: collections.deque[int] = collections.deque()
        self.prompts_started = 0
        self.version = 0
        self.trainer_end: float | None = None
        self.batch: list[int] = []
        self.heap: list[tuple[float, int, int, int]] = []
        self.step_log: list[tuple[float, float, float, int, np.ndarray, np.ndarray]] = []
        self.busy_time = 0.0
        self.slot_time = 0.0  # integral of active slots over decode time
        self.decode_time = 0.0

    # -- samples and admission -------------------------------------------------------------------------
    def _grow(self, need: int):
        if need <= len(self.length):
            return
        cap = max(need, 2 * len(self.length))
        for name in ("length", "remaining", "start_version", "vsum"):
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _admit(self) -> bool:
        """Start the next prompt if floor((started + 1 - 1) / B) <= version + η (AReaL's rule)."""
        if self.prompts_started // self.wl.prompts_per_batch > self.version + self.max_staleness:
            return False
        g = self.wl.samples_per_prompt
        ids = list(range(self.n_samples, self.n_samples + g))
        self._grow(self.n_samples + g)
        lens = self.wl.group_lengths(self.rng)
        self.length[ids] = lens
        self.remaining[ids] = lens
        self.vsum[ids] = 0.0
        self.n_samples += g
        gid = self.prompts_started
        self.prompts_started += 1
        self.group_left[gid] = g
        self.group_members[gid] = ids
        self.pending.extend(ids)
        return True

    def _share(self) -> int:
        """Slots a replica may fill: an even share of all work in sight (a least-loaded router)."""
        window = (self.version + self.max_staleness + 1) * self.wl.prompts_per_batch  # AReaL's admission
        admissible = max(0, window - self.prompts_started)
        demand = self.n_active + len(self.pending) + admissible * self.wl.samples_per_prompt
        return min(self.sp.max_batch, max(1, -(-demand // self.n_rep)))

    def _fill(self, rep: _Replica) -> int:
        """Move admitted samples into free slots (up to the even share); returns how many were placed."""
        placed = 0
        share = self._share()
        while len(rep.active) < share:
            if not self.pending and not self._admit():
                break
            i = self.pending.popleft()
            self.start_version[i] = self.version
            rep.active.append(i)
            placed += 1
        self.n_active += placed
        return placed

    # -- replica chunks -------------------------------------------------------------------------------
    def _plan(self, r: int, now: float, stall: float):
        rep = self.reps[r]
        if not rep.active:
            rep.busy = False
            return
        b = len(rep.active)
        rep.dt = self.sp.step_s(b)
        rep.k = int(self.remaining[rep.active].min())
        rep.chunk_start = now + stall
        self._truncate(rep, r)
        rep.end = rep.chunk_start + rep.k * rep.dt
        rep.busy = True
        rep.seq += 1
        heapq.heappush(self.heap, (rep.end, 1, r, rep.seq))

    def _truncate(self, rep: _Replica, r: int) -> bool:
        """Stop the chunk after the decode step in flight when the trainer publishes (in-flight update)."""
        if self.trainer_end is None or self.trainer_end <= rep.chunk_start:
            return False
        k = max(1, math.ceil((self.trainer_end - rep.chunk_start) / rep.dt - 1e-9))
        if k >= rep.k:
            return False
        rep.k = k
        return True

    def _service(self, r: int, now: float, wake: bool = True):
        """End of replica r's chunk: account tokens, retire finished samples, refill, plan the next chunk."""
        rep = self.reps[r]
        was_busy, rep.busy = rep.busy, False
        if was_busy and rep.active:
            act = np.asarray(rep.active)
            self.remaining[act] -= rep.k
            self.vsum[act] += rep.k * rep.version
            self.slot_time += len(act) * rep.k * rep.dt
            self.decode_time += rep.k * rep.dt
            finished = act[self.remaining[act] == 0]
            if len(finished):
                rep.active = [int(i) for i in act[self.remaining[act] > 0]]
                self.n_active -= len(finished)
                for i in finished:
                    gid = int(i) // self.wl.samples_per_prompt
                    self.group_left[gid] -= 1
                    if self.group_left[gid] == 0:
                        if self.sp.admit_lag_s > 0:  # the trainer sees it admit_lag_s later
                            heapq.heappush(self.heap, (now + self.sp.admit_lag_s, 2, gid, 0))
                        else:
                            self.done_groups.append(gid)
                self._maybe_train(now)
        stall = self.sp.prefill_s * self._fill(rep)
        if rep.active and rep.version != self.version:
            stall += self.sp.update_s
            rep.version = self.version
        self._plan(r, now, stall)
        if wake and self.pending:
            self._wake_idle(now)

    def _wake_idle(self, now: float):
        """Give waiting work to idle replicas, then make busy ones with spare share stop after this step."""
        for r, rep in enumerate(self.reps):
            if not rep.busy and (self.pending or self._can_admit()):
                self._service(r, now, wake=False)
        if not (self.pending or self._can_admit()):
            return
        share = self._share()
        for r, rep in enumerate(self.reps):
            if rep.busy and len(rep.active) < share and rep.chunk_start < now:
                k = max(1, math.ceil((now - rep.chunk_start) / rep.dt - 1e-9))
                if k < rep.k:
                    rep.k = k
                    rep.end = rep.chunk_start + k * rep.dt
                    rep.seq += 1
                    heapq.heappush(self.heap, (rep.end, 1, r, rep.seq))

    def _can_admit(self) -> bool:
        return self.prompts_started // self.wl.prompts_per_batch <= self.version + self.max_staleness

    # -- trainer ---------------------------------------------------------------------------------------
    def _maybe_train(self, now: float):
        if self.trainer_end is not None or len(self.done_groups) < self.wl.prompts_per_batch:
            return
        groups = [self.done_groups.popleft() for _ in range(self.wl.prompts_per_batch)]
        self.batch = [i for g in groups for i in self.group_members.pop(g)]
        for g in groups:
            del self.group_left[g]
        ids = np.asarray(self.batch)
        resp = float(self.length[ids].sum())
        dur = self.sys.trainer.step_s(resp + len(ids) * self.wl.prompt_len, self.trainer_devices)
        self.trainer_end = now + dur
        self.busy_time += dur
        head = self.version - self.start_version[ids]
        tok = self.version - self.vsum[ids] / self.length[ids]
        self.step_log.append((now, self.trainer_end, resp, len(ids), head, tok * self.length[ids]))
        heapq.heappush(self.heap, (self.trainer_end, 0, -1, 0))
        for r, rep in enumerate(self.reps):
            if rep.busy and self._truncate(rep, r):
                rep.end = rep.chunk_start + rep.k * rep.dt
                rep.seq += 1
                heapq.heappush(self.heap, (rep.end, 1, r, rep.seq))

    def _train_done(self, now: float):
        self.trainer_end = None
        self.version += 1
        self._maybe_train(now)
        self._wake_idle(now)

    def run(self, n_steps: int) -> None:
        self._wake_idle(0.0)
        while len(self.step_log) < n_steps + 1 and self.heap:
            t, kind, r, seq = heapq.heappop(self.heap)
            if kind == 0:
                self._train_done(t)
            elif kind == 2:  # a finished group reaches the trainer (Sampler.admit_lag_s)
                self.done_groups.append(r)
                self._maybe_train(t)
            elif seq == self.reps[r].seq:
                self._service(r, t)
        if len(self.step_log) < n_steps + 1:
            raise RuntimeError("simulation stalled: the sampler can never fill a train batch")


def simulate(
    system: System,
    sampler_devices: int,
    trainer_devices: int,
    *,
    sync: bool = False,
    steps: int = 30,
    warmup: int = 5,
    seed: int = 0,
) -> SimResult:
    """Simulate a split (or sync RL on all devices when `sync`) and measure after `warmup` train steps."""
    if sync:
        sampler_devices = trainer_devices = system.total_devices
    max_staleness = 0 if sync else system.max_staleness
    sim = _Sim(system, sampler_devices, trainer_devices, max_staleness, seed)
    sim.run(warmup + steps)
    log = sim.step_log[warmup : warmup + steps + 1]
    # Consumption rate between the starts of consecutive train steps.
    span = log[-1][0] - log[0][0]
    resp = sum(x[2] for x in log[:-1])
    samples = sum(x[3] for x in log[:-1])
    heads = np.concatenate([x[4] for x in log[:-1]])
    tok_weighted = sum(float(x[5].sum()) for x in log[:-1])
    busy = sum(x[1] - x[0] for x in log[:-1])
    occ = sim.slot_time / max(sim.decode_time * sim.sp.max_batch, 1e-30)
    return SimResult(
        tokens_per_s=resp / span,
        samples_per_s=samples / span,
        step_period_s=span / steps,
        max_staleness=int(heads.max()),
        mean_staleness=float(heads.mean()),
        mean_token_staleness=tok_weighted / resp,
        trainer_busy=busy / span,
        sampler_occupancy=float(occ),
        steps=steps,
    )
