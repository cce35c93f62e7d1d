"""Parallel reward service: a pool of worker processes grading completions while the sampler runs.

Any exception, hang or worker death yields reward 0.0 with a counted, logged reason; a hung or dead
worker is replaced. Workers are spawned (never forked: the parent may hold JAX threads), so reward
functions must be importable by name in a fresh interpreter (see `get_reward`).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait as mp_wait
from typing import Any, NamedTuple

from jaxrl_async.rewards.answers import ANSWER_RULES
from jaxrl_async.rewards.registry import as_graded, check_reward_name, get_reward, is_builtin

log = logging.getLogger(__name__)

_REASON_OK = "ok"
_LOG_FIRST_N = 5  # per reason; then every 100th, so a broken reward cannot flood the log
_READY = "ready"  # a worker's first message: its imports are done


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward service settings.

    Attributes:
      reward: default reward (built-in name, registered name or "pkg.module:fn"); a request's
        metadata["reward"] overrides it. Construction imports nothing: it rejects a name that is neither
        known nor an import path (unless `imports` may register it); `RewardService` loads the rest.
      format_weight: adds `format_weight * format_reward` to every reward (0 disables).
      num_workers: worker processes.
      timeout_s: per-call limit on the whole reward function; past it the worker is killed and replaced.
      max_queue: requests waiting for a worker; `submit` blocks (or raises queue.Full) beyond it.
      imports: modules each worker imports at start-up (to run their `@register_reward` decorators);
        `RewardService` imports them first in its own process, so a bad name fails there.
      defaults: metadata defaults merged under each request's metadata (e.g. {"sandbox": {...}}).
      mp_context: "spawn" or "forkserver".
      overlong_buffer: DAPO's soft overlong punishment (rewards/shaping.py): completions within this many
        tokens of sampler.max_new_tokens lose up to `overlong_penalty` reward, linearly; 0 = off.
      overlong_penalty: the shaping term's magnitude at the cap.
      answer_rule: the math reward's answer rule (rewards/math.py): "last" grades only the final marked
        answer (self-corrections count); "agree" also requires every other marked answer to equal it.
        A request's metadata["answer_rule"] (or `defaults`) overrides it.
    """

    reward: str = "arithmetic"
    format_weight: float = 0.0
    num_workers: int = 2
    timeout_s: float = 10.0
    max_queue: int = 4096
    imports: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mp_context: str = "spawn"
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    answer_rule: str = "last"

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"RewardConfig: num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"RewardConfig: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_queue < 1:
            raise ValueError(f"RewardConfig: max_queue must be >= 1, got {self.max_queue}")
        if self.mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"RewardConfig: mp_context must be spawn or forkserver, got {self.mp_context!r}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(
                f"RewardConfig: overlong_buffer and overlong_penalty must be >= 0, got "
                f"{self.overlong_buffer}, {self.overlong_penalty}"
            )
        if self.answer_rule not in ANSWER_RULES:
            raise ValueError(
                f"RewardConfig: answer_rule must be one of {ANSWER_RULES}, got {self.answer_rule!r}"
            )
        if not self.imports:  # a name the imports register is known only once they ran
            check_reward_name(self.reward)


class Request(NamedTuple):
    """One request on the pipe to a worker (and the job a worker holds until it answers)."""

    request_id: Any
    prompt: str
    completion: str
    metadata: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """One graded request; `reason` is "ok", "timeout", "worker_died", "error:<ExceptionType>", ..."""

    request_id: Any
    reward: float
    reason: str
    elapsed_s: float
    info: str = ""


class QueueFull(Exception):
    """`submit(block=False)` found the queue at `max_queue`."""


def grade_one(cfg: RewardConfig, prompt: str, completion: str, metadata: Mapping[str, Any]):
    """Grades one request in this process: returns (reward, reason, info); never raises."""
    try:
        meta = {"answer_rule": cfg.answer_rule, **cfg.defaults, **metadata}
        out = as_graded(get_reward(meta.get("reward", cfg.reward))(prompt, completion, meta))
        reward = out.reward
        if cfg.format_weight:
            reward += cfg.format_weight * as_graded(get_reward("format")(prompt, completion, meta)).reward
        return reward, _REASON_OK, out.info
    except Exception as e:  # noqa: BLE001 - any failure of user code is a zero reward, never a crash
        return 0.0, f"error:{type(e).__name__}", str(e)[:300]


def _load(cfg: RewardConfig, builtins: bool) -> None:
    """Imports `cfg.imports` and the default reward's module (with `builtins`, also the package's own
    rewards and the format reward), raising what a bad name raises."""
    for mod in cfg.imports:
        importlib.import_module(mod)
    if builtins or not is_builtin(cfg.reward):
        get_reward(cfg.reward)
    if builtins and cfg.format_weight:
        get_reward("format")


def _worker_main(conn, cfg: RewardConfig):
    """Worker loop: receives a Request, sends back a RewardResult (None ends it)."""
    # Loading now keeps the reward's import time out of the first call's timeout.
    _load(cfg, builtins=True)
    conn.send(_READY)
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        if req is None:
            return
        start = time.monotonic()
        reward, reason, info = grade_one(cfg, req.prompt, req.completion, req.metadata)
        conn.send(RewardResult(req.request_id, reward, reason, time.monotonic() - start, info))


@dataclasses.dataclass
class _Worker:
    proc: Any
    conn: Any
    ready: bool = False
    job: Request | None = None  # the request in flight
    started: float = 0.0


class RewardService:
    """A pool of reward worker processes fed through a bounded queue.

    Example:
      svc = RewardService(RewardConfig(reward="math", num_workers=4))
      svc.submit("r0", prompt, completion, {"answer": "3/4"})
      ...                      # keep sampling
      for res in svc.poll():   # RewardResult(request_id, reward, reason, elapsed_s, info)
          ...
      svc.close()
    """

    def __init__(self, cfg: RewardConfig, clock: Callable[[], float] = time.monotonic):
        """`clock` (seconds) times each call against `cfg.timeout_s`; tests pass one they advance, so that
        only the call under test times out however loaded the host is."""
        # A name a worker cannot load fails here, not in a loop of dying workers. The package's own
        # rewards are known good and stay out of this process (math-verify pulls in sympy).
        _load(cfg, builtins=False)
        self.cfg = cfg
        self._clock = clock
        self._ctx = mp.get_context(cfg.mp_context)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: collections.deque = collections.deque()
        self._results: collections.deque = collections.deque()
        self._batch: dict[Any, RewardResult | None] = {}
        self._counts: collections.Counter = collections.Counter()
        self._closed = False
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [self._start_worker() for _ in range(cfg.num_workers)]
        self._batch_ids = itertools.count()
        self._thread = threading.Thread(target=self._dispatch_loop, name="reward-dispatch", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------------

    def submit(
        self,
        request_id: Any,
        prompt: str,
        completion: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        block: bool = True,
        timeout: float | None = None,
    ) -> None:
        """Queues one request; returns at once unless the queue is full (then blocks, or raises QueueFull
        when `block=False` or after `timeout` seconds)."""
        item = Request(request_id, prompt, completion, dict(metadata or {}))
        with self._cond:
            if self._closed:
                raise RuntimeError("RewardService is closed")
            if len(self._pending) >= self.cfg.max_queue:
                if not block:
                    raise QueueFull(f"reward queue is full ({self.cfg.max_queue})")
                if not self._cond.wait_for(lambda: len(self._pending) < self.cfg.max_queue, timeout):
                    raise QueueFull(f"reward queue still full after {timeout}s")
            self._pending.append(item)
        self._wake()

    def poll(self) -> list[RewardResult]:
        """Results finished since the last poll (non-blocking)."""
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def wait(self, timeout: float) -> bool:
        """Blocks until a result is ready for `poll` or `timeout` seconds pass; True if one is ready."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._results), timeout)

    def grade_batch(
        self, items: Sequence[tuple[str, str, Mapping[str, Any]]], timeout: float | None = None
    ) -> list[float]:
        """Grades (prompt, completion, metadata) items in parallel and returns their rewards in order."""
        return [r.reward for r in self.grade_batch_results(items, timeout)]

    def grade_batch_results(
        self, items: Sequence[tuple[str, str, Mapping[str, Any]]], timeout: float | None = None
    ) -> list[RewardResult]:
        """Like grade_batch but returns the full results (reason, info, time); not seen by poll()."""
        ids = [("_batch", next(self._batch_ids)) for _ in items]
        with self._lock:
            self._batch.update({i: None for i in ids})
        for rid, (prompt, completion, metadata) in zip(ids, items, strict=True):
            self.submit(rid, prompt, completion, metadata)
        with self._cond:
            if not self._cond.wait_for(lambda: all(self._batch[i] is not None for i in ids), timeout):
                raise TimeoutError(f"grade_batch: not finished after {timeout}s")
            return [self._batch.pop(i) for i in ids]

    def stats(self) -> dict[str, Any]:
        """Counters: graded, ok, errors by reason, timeouts, worker restarts, queue depth, in flight."""
        with self._lock:
            c = dict(self._counts)
            in_flight = sum(w.job is not None for w in self._workers)
            depth = len(self._pending)
        errors = {k: v for k, v in c.items() if k not in (_REASON_OK, "graded", "worker_restarts")}
        return {
            "graded": c.get("graded", 0),
            "ok": c.get(_REASON_OK, 0),
            "errors": errors,
            "timeouts": c.get("timeout", 0),
            "worker_restarts": c.get("worker_restarts", 0),
            "queue_depth": depth,
            "in_flight": in_flight,
            "workers_alive": sum(w.proc.is_alive() for w in self._workers),
        }

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Blocks until every worker has started (imports done); useful before timing."""
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self._workers):
            if time.monotonic() > deadline:
                raise TimeoutError("reward workers did not start in time")
            time.sleep(0.01)

    def close(self) -> None:
        """Stops the workers (unfinished requests are dropped)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(timeout=10)
        for w in self._workers:
            self._stop_worker(w, graceful=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals --------------------------------------------------------------------------------

    def _wake(self):
        try:
            self._wake_w.send_bytes(b"x")
        except OSError:
            pass

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.cfg), daemon=True, name="reward-worker"
        )
        proc.start()
        child.close()
        return _Worker(proc=proc, conn=parent)

    def _stop_worker(self, w: _Worker, graceful: bool):
        if graceful and w.proc.is_alive():
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.proc.join(timeout=2)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5)
        w.conn.close()
        if w.proc.pid is not None:
            # A killed worker leaves its sandboxed programs orphaned; they run under its uid range.
            from jaxrl_async.rewards.sandbox import kill_leftovers

            kill_leftovers(w.proc.pid)

    def _deliver(self, res: RewardResult):
        with self._cond:
            self._counts["graded"] += 1
            self._counts[res.reason] += 1
            n = self._counts[res.reason]
            if isinstance(res.request_id, tuple) and res.request_id[:1] == ("_batch",):
                self._batch[res.request_id] = res
            else:
                self._results.append(res)
            self._cond.notify_all()
        if res.reason != _REASON_OK and (n <= _LOG_FIRST_N or n % 100 == 0):
            log.warning("reward %r -> 0 (%s, #%d): %s", res.request_id, res.reason, n, res.info)

    def _replace(self, i: int, reason: str, info: str):
        w = self._workers[i]
        if w.job is not None:
            self._deliver(RewardResult(w.job.request_id, 0.0, reason, self._clock() - w.started, info))
        self._stop_worker(w, graceful=False)
        with self._lock:
            self._counts["worker_restarts"] += 1
            w.job = None
        if not self._closed:
            self._workers[i] = self._start_worker()

    def _assign(self):
        for w in self._workers:
            if not w.ready or w.job is not None:
                continue
            with self._cond:
                if not self._pending:
                    return
                item = self._pending.popleft()
                self._cond.notify_all()
            w.started = self._clock()
            try:
                w.conn.send(item)
                w.job = item
            except Exception as e:  # noqa: BLE001 - e.g. unpicklable metadata; the worker is fine
                why = f"error:{type(e).__name__}"
                self._deliver(RewardResult(item.request_id, 0.0, why, 0.0, str(e)[:300]))

    def _dispatch_loop(self):
        while not self._closed:
            self._assign()
            conns = {w.conn: i for i, w in enumerate(self._workers)}
            sentinels = {w.proc.sentinel: i for i, w in enumerate(self._workers)}
            ready = mp_wait([self._wake_r, *conns, *sentinels], timeout=0.05)
            for obj in ready:
                if obj is self._wake_r:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                elif obj in conns:
                    self._receive(conns[obj])
            now = self._clock()
            for i, w in enumerate(self._workers):
                if w.job is not None and now - w.started > self.cfg.timeout_s:
                    self._replace(i, "timeout", f"no result after {self.cfg.timeout_s}s; worker replaced")
                elif not w.proc.is_alive() and not self._closed:
                    self._replace(i, "worker_died", f"worker exited with code {w.proc.exitcode}")

    def _receive(self, i: int):
        w = self._workers[i]
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return  # the liveness check replaces it
        if msg == _READY:
            w.ready = True
            return
        w.job = None
        self._deliver(msg)
