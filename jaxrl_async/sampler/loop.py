"""The host-side sampler loop: continuous batching, group sampling, completions and weight updates.

One `step()` = admit requests into free slots (pull-based), dispatch one `generate` call (k decode steps),
then read back the previous call's tokens while this one runs (`overlap_host`). Only the previous call's
`done` flags are read before admitting, so a slot that finished in call k is refilled for call k + 1;
parsing tokens into completions overlaps call k + 1. The loop is a plain sequential event loop: easy to
trace, no threads.

Memory is the engine's planner's business (`engine.new_planner()`: `page_table.PagePlanner` for the paged
cache, the trivial `SlotPlanner` for the slotted one), so the loop has one code path for both:
  - admission: groups are taken while the planner has room for their samples, and each sample goes to
    the slot the planner places it in (paged: a shard with free pages for its prompt and first call, on
    top of the pages the running sequences need for their next call);
  - growth: before each call the planner gives every running sequence the pages that call writes, and
    returns the sequences to preempt when a shard runs out (waiting groups give up their prompt pages
    first, then the youngest sequence of the shard goes). The loop preempts them: their slots are
    released, their tokens dropped, and their samples re-queued at the front, to restart from the prompt
    with the same seed. Youngest, because it has done the least work; restart rather than resume, because
    every token of a completion then comes from one uninterrupted decode (its logprobs and versions need
    no special case), and under unchanged weights the restart draws the same tokens again;
  - group samples share their prompt's full pages: `_Group.shared` ({shard: pages}) holds one reference
    per shard until all samples are inserted, and a page is freed when its last holder finishes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_async.sampler.config import UPDATE_MODES
from jaxrl_async.sampler.engine import Engine, Prefix, Round


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt to sample `n_samples` completions of (they share one prefill).

    Attributes:
      uid: caller's id, copied into every completion.
      prompt_tokens: token ids (at least one).
      n_samples: completions wanted (GRPO group size).
      seed: completions i of a request use the random stream (seed, i), whatever slot they land in.
      max_new_tokens: None = the engine's max_new_tokens.
      metadata: anything; copied into every completion.
      park: a multi-turn episode: when a sample's turn ends its slot is parked with its KV cache in place
        (its Completion has `parked=True`) until the caller appends an observation (`resume`) or lets it
        go (`finish`).
    """

    uid: Any
    prompt_tokens: tuple[int, ...]
    n_samples: int = 1
    seed: int = 0
    max_new_tokens: int | None = None
    metadata: Any = None
    park: bool = False

    def __post_init__(self):
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in self.prompt_tokens))
        if not self.prompt_tokens:
            raise ValueError(f"Request {self.uid!r}: empty prompt")
        if self.n_samples < 1:
            raise ValueError(f"Request {self.uid!r}: n_samples must be >= 1, got {self.n_samples}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"Request {self.uid!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass(frozen=True)
class Completion:
    """One finished sample.

    Attributes:
      tokens: int32 generated tokens (a stop token, if any, is the last one).
      logprobs: float32 log softmax(logits / T)[token] under the weights that produced it (the trainer's
        definition, full vocabulary; T = 1 when greedy).
      sample_logprobs: float32 log-probability under the top-k/top-p-truncated distribution actually
        sampled from (equal to logprobs without truncation; 0 when greedy).
      versions: int64 weight version that produced each token.
      finish_reason: "stop" (a stop token) or "length" (max_new_tokens reached).
      parked: the request parks its slots (`Request.park`): this is one turn, and the slot waits for
        `resume` or `finish`. `tokens` are this turn's; `prompt_tokens` the request's prompt.
    """

    uid: Any
    sample_index: int
    prompt_tokens: tuple[int, ...]
    tokens: np.ndarray
    logprobs: np.ndarray
    sample_logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    metadata: Any = None
    parked: bool = False


@dataclasses.dataclass
class SamplerStats:
    """Counters since the loop started; occupancy counts slot-steps that produced a token.

    `preemptions` counts sequences restarted because the paged cache ran out of pages; `peak_live` is the
    most sequences that ran in one call. `extensions` counts observations appended to parked slots
    (`extension_tokens` their tokens); `parked_slot_steps` counts decode steps of parked slots.
    """

    calls: int = 0
    decode_steps: int = 0
    tokens_generated: int = 0
    slot_steps: int = 0
    prefills: int = 0
    requests_admitted: int = 0
    completions: int = 0
    weight_updates: int = 0
    preemptions: int = 0
    peak_live: int = 0
    extensions: int = 0
    extension_tokens: int = 0
    parked_slot_steps: int = 0

    @property
    def parked_fraction(self) -> float:
        """Share of the slot-steps of dispatched calls that parked slots held (multi-turn episodes)."""
        return self.parked_slot_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def occupancy(self) -> float:
        return self.tokens_generated / self.slot_steps if self.slot_steps else 0.0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.occupancy if self.slot_steps else 0.0


@dataclasses.dataclass
class _Group:
    """An admitted request whose samples are not all inserted yet (oldest first in the loop's deque)."""

    request: Request
    max_new_tokens: int
    samples: collections.deque  # sample indices still to insert
    prefix: Prefix | None = None
    shared: dict = dataclasses.field(default_factory=dict)  # shard -> prompt pages the group holds (paged)


@dataclasses.dataclass
class _Live:
    request: Request
    sample_index: int
    max_new_tokens: int = 0
    context: tuple = ()  # the tokens before this turn (the prompt, and earlier turns and observations)
    parked: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    sample_logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    finished: bool = False
    preempted: bool = False


class SamplerLoop:
    """Keeps the engine's slots full from a pull-based request source and applies weight updates.

    Args:
      engine: the Engine.
      static_batching: admit only when every slot is free (a baseline for benchmarks).
    """

    def __init__(self, engine: Engine, static_batching: bool = False):
        self.engine, self.cfg = engine, engine.cfg
        self.static_batching = static_batching
        self.stats = SamplerStats()
        self._state = engine.init_state()
        self._slots: list[_Live | None] = [None] * self.cfg.num_slots
        self._groups: collections.deque[_Group] = collections.deque()  # admitted, samples left to insert
        self._queue: collections.deque[Request] = collections.deque()  # pushed via add_request
        self._pending: tuple[Round, list] | None = None  # dispatched, not yet read back
        self._ready: list[Completion] = []  # finished outside step() (flushes), returned by the next step
        self._staged: tuple[dict, int] | None = None  # weights waiting for running sequences ("finish")
        self._stop = set(self.cfg.stop_tokens)
        self._source_empty = False  # the last admission found no request to take
        self._planner = engine.new_planner()  # admission, placement, growth, preemption; the page table
        self._parked: dict[tuple, int] = {}  # (uid, sample_index) -> slot of a parked turn (`Request.park`)
        self._resumes: collections.deque = collections.deque()  # resumes waiting for pages (paged cache)

    @property
    def planner(self):
        """The planner of this loop's decode state (`page_table.PagePlanner` or `SlotPlanner`)."""
        return self._planner

    # ----- requests -----

    def add_request(self, request: Request) -> None:
        """Queues a request (push-style alternative to the `admit` callback); fails if it cannot fit."""
        self._check(request)
        self._queue.append(request)

    def can_admit(self) -> bool:
        """Whether the next step would take a new request (a free slot, with the paged cache pages for a
        prompt of max_prompt_len in its shard, and not waiting for a weight swap)."""
        if not (self._admitting() and not self._groups and not self._queue):
            return False
        free = [b for b, s in enumerate(self._slots) if s is None]
        return self._planner.can_admit(free, self.cfg.max_prompt_len, self.cfg.max_new_tokens)

    @property
    def free_slots(self) -> int:
        """Slots not holding a running sequence (as far as the host knows)."""
        return sum(s is None for s in self._slots)

    @property
    def num_live(self) -> int:
        """Slots holding a running sequence (as far as the host knows)."""
        return sum(s is not None for s in self._slots)

    @property
    def num_running(self) -> int:
        """Slots holding a sequence that decodes (live and not parked)."""
        return sum(s is not None and not s.parked for s in self._slots)

    @property
    def parked(self) -> list[tuple]:
        """(uid, sample_index) of the parked turns, waiting for `resume` or `finish`."""
        return list(self._parked)

    @property
    def idle(self) -> bool:
        """Nothing running, in flight, waiting to be inserted or resumed (parked turns wait for the caller:
        they do not keep the loop busy)."""
        return (
            not self.num_running
            and self._pending is None
            and not self._groups
            and not self._queue
            and not self._resumes
        )

    @property
    def stuck(self) -> bool:
        """Resumes wait for KV pages and no sequence runs (or is in flight) that could free any: only a
        `finish` of a parked turn can let them go on."""
        return bool(self._resumes) and not self.num_running and self._pending is None

    # ----- multi-turn episodes -----

    def resume(self, uid, sample_index: int, observation, max_new_tokens: int | None = None) -> None:
        """Appends `observation` (token ids) to a parked turn's sequence and lets it decode again: a prefill
        of the observation on top of the slot's KV cache (`Engine.extend`), not of the whole context. With
        the paged cache the slot first gets the pages the observation and its next call write; when its
        shard has none free the resume waits (retried every step).

        Raises:
          KeyError: no parked turn (uid, sample_index).
          ValueError: an empty observation, or one that (with max_new_tokens) no longer fits the slot; with
            the paged cache also a context past max_prompt_len (a preempted turn restarts from its whole
            context, prefilled like a prompt).
        """
        key = (uid, sample_index)
        b = self._parked[key]
        live = self._slots[b]
        obs = tuple(int(t) for t in observation)
        max_new = max_new_tokens or self.cfg.max_new_tokens
        context = len(live.context) + len(live.tokens)
        if not obs:
            raise ValueError(f"resume {key}: an empty observation")
        if context + len(obs) + max_new > self.engine.capacity:
            raise ValueError(
                f"resume {key}: a context of {context} tokens + an observation of {len(obs)} + "
                f"max_new_tokens={max_new} exceeds the slot's capacity {self.engine.capacity}"
            )
        if self.engine.paged and context + len(obs) > self.cfg.max_prompt_len:
            raise ValueError(
                f"resume {key}: the paged cache restarts a preempted turn from its whole context, which must "
                f"fit max_prompt_len={self.cfg.max_prompt_len} (it would hold {context + len(obs)} tokens)"
            )
        del self._parked[key]
        self._resumes.append((b, obs, max_new))
        self._start_resumes()

    def finish(self, uid, sample_index: int) -> None:
        """Ends a parked turn's episode: its slot (and pages) are free again.

        Raises:
          KeyError: no parked turn (uid, sample_index).
        """
        self._free_slot(self._parked.pop((uid, sample_index)))

    def _start_resumes(self) -> None:
        """Extends the parked slots whose resumes can get their pages (oldest first)."""
        waiting = collections.deque()
        while self._resumes:
            b, obs, max_new = self._resumes.popleft()
            live = self._slots[b]
            context = (*live.context, *live.tokens)
            if not self._planner.extend(b, len(context) + len(obs), max_new):
                waiting.append((b, obs, max_new))
                continue
            table = self._planner.host_table()
            self._state = self.engine.extend(self._state, b, len(context), obs, max_new, *table)
            # A new record for the new turn: rounds dispatched while the slot was parked still name the old
            # one (finished), so their `done` flag for this slot is not taken for the new turn's end.
            self._slots[b] = _Live(live.request, live.sample_index, max_new, context=(*context, *obs))
            self.stats.extensions += 1
            self.stats.extension_tokens += len(obs)
        self._resumes = waiting

    # ----- stepping -----

    def step(self, admit: Callable[[], Request | None] | None = None) -> list[Completion]:
        """Admits into free slots (queued requests first, then `admit()` until it returns None), runs one
        generate call, and returns the completions that finished."""
        self._maybe_swap_staged()
        self._source_empty = False
        if self._pending is not None:
            self._release_finished(*self._pending)
        if self._resumes:
            self._start_resumes()
        if self._admitting():
            self._admit(admit)
        for b in self._planner.grow([g.shared for g in self._groups]):
            self._preempt(b)
        new = None
        if self.num_running:  # parked slots alone are not worth a call: with every slot parked, nothing runs
            self._state, rnd = self.engine.generate(self._state, *self._planner.device_table())
            new = (rnd, list(self._slots))
            self._planner.dispatched()
            self.stats.calls += 1
            self.stats.decode_steps += self.cfg.steps_per_call
            self.stats.parked_slot_steps += (self.num_live - self.num_running) * self.cfg.steps_per_call
            self.stats.peak_live = max(self.stats.peak_live, self.num_live)
        done, self._ready = self._ready, []
        if self._pending is not None:
            done += self._process(*self._pending)
        self._pending = new
        if not self.cfg.overlap_host:
            self._flush_into(done)
        self._maybe_swap_staged()
        return done

    def run(
        self, admit: Callable[[], Request | None] | None = None, max_steps: int | None = None
    ) -> list[Completion]:
        """Steps until nothing is left to do (queue and `admit` exhausted); returns all completions.

        Raises:
          RuntimeError: resumes wait for pages that nothing running will free (every other sequence of
            their shard is parked): only the caller can `finish` one, so stepping on would never end.
        """
        out, n = [], 0
        while True:
            out += self.step(admit)
            n += 1
            # Idle with every slot parked: nothing can be admitted or run until the caller resumes one.
            drained = self._source_empty or not self.free_slots
            if (self.idle and drained and self._staged is None) or (max_steps is not None and n >= max_steps):
                return out
            if self.stuck:
                keys = [(self._slots[b].request.uid, self._slots[b].sample_index) for b, *_ in self._resumes]
                raise RuntimeError(
                    f"resumes of {keys} wait for KV pages, but no sequence runs to free any: finish a parked "
                    "turn first, or give the paged cache more pages (config.sampler.token_budget)"
                )

    # ----- weight updates -----

    def update_params(self, params: dict, version: int, mode: str | None = None) -> None:
        """Swaps weights between decode steps.

        Modes: "keep_kv" continues running sequences on their existing KV cache (PipelineRL);
        "recompute_kv" re-prefills every running sequence (prompt + tokens so far) with the new weights
        (AReaL); "finish" stops admitting, lets running sequences finish, then swaps. Tokens are stamped
        with the version of the weights that produced their logits.

        Raises:
          ValueError: unknown mode, or params that do not match the engine (naming the leaf).
        """
        mode = mode or self.cfg.update_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode {mode!r} not in {UPDATE_MODES}")
        if mode == "finish":
            self.engine.validate(params)
            self._staged = (params, version)
            return
        self._staged = None
        self.engine.update_params(params, version)
        self.stats.weight_updates += 1
        if mode == "recompute_kv":
            self._flush_into(self._ready)
            # Parked slots too: their cache holds the episode so far, observations included.
            sequences = [None if s is None else (*s.context, *s.tokens)[:-1] for s in self._slots]
            if any(s is not None for s in sequences):
                table = self._planner.host_table()
                self._state = self.engine.recompute_kv(self._state, sequences, *table)
            self._forget_prefixes()  # samples not yet inserted are prefilled again with the new weights

    # ----- internals -----

    def _admitting(self) -> bool:
        return self._staged is None

    def _maybe_swap_staged(self) -> None:
        # Parked turns do not hold a "finish" swap back: their episode goes on under the new weights.
        if self._staged is not None and not self.num_running and self._pending is None:
            params, version = self._staged
            self._staged = None
            self.engine.update_params(params, version)
            self.stats.weight_updates += 1
            self._forget_prefixes()

    def _forget_prefixes(self) -> None:
        """Drops waiting groups' prefixes and shared prompt pages (they hold KV of the old weights)."""
        for g in self._groups:
            g.prefix = None
            self._planner.drop_shared(g.shared)

    def _check(self, request: Request) -> int:
        max_new = request.max_new_tokens or self.cfg.max_new_tokens
        if max_new > self.cfg.max_new_tokens:
            raise ValueError(
                f"Request {request.uid!r}: max_new_tokens={max_new} > the engine's {self.cfg.max_new_tokens}"
            )
        try:
            self.engine.check_fits(len(request.prompt_tokens), max_new)
        except ValueError as e:
            raise ValueError(f"Request {request.uid!r} cannot fit: {e}") from None
        return max_new

    def _pull_group(self, admit) -> _Group | None:
        """The next request (queued first, then `admit()`) as a group, or None when there is none."""
        req = self._queue.popleft() if self._queue else (admit() if admit is not None else None)
        if req is None:
            return None
        group = _Group(req, self._check(req), collections.deque(range(req.n_samples)))
        self._groups.append(group)
        self.stats.requests_admitted += 1
        return group

    def _admit(self, admit) -> None:
        if self.static_batching and (self.num_live or self._pending is not None):
            return
        free = [b for b, s in enumerate(self._slots) if s is None]
        # Groups (oldest first) whose samples fill the free slots and the planner's room (paged: free pages;
        # slotted: unbounded); their prompts are prefilled together.
        planned, n_groups = 0, 0
        room = self._planner.admission_room(free)
        while planned < len(free) and room > 0:
            if n_groups == len(self._groups) and self._pull_group(admit) is None:
                self._source_empty = True
                break
            group = self._groups[n_groups]
            planned += len(group.samples)
            p = len(group.request.prompt_tokens)
            room -= self._planner.group_pages(p, group.max_new_tokens, len(group.samples), bool(group.shared))
            n_groups += 1
        todo = [g for g in list(self._groups)[:n_groups] if g.prefix is None]
        if todo:
            prefixes = self.engine.prefill_many([g.request.prompt_tokens for g in todo])
            for group, prefix in zip(todo, prefixes, strict=True):
                group.prefix = prefix
            self.stats.prefills += len(todo)
        while free and self._groups and self._groups[0].prefix is not None:
            group = self._groups[0]
            p = len(group.request.prompt_tokens)
            while free and group.samples:
                b = self._planner.place(p, group.max_new_tokens, free, group.shared)
                if b is None:
                    return  # out of pages: the group waits at the head of the queue
                free.remove(b)
                self._insert(group, b, group.samples.popleft())
            if not group.samples:
                self._groups.popleft()
                self._planner.drop_shared(group.shared)

    def _insert(self, group: _Group, b: int, i: int) -> None:
        req = group.request
        dest = self._planner.start(b, len(req.prompt_tokens), group.max_new_tokens, group.shared)
        self._state = self.engine.insert(
            self._state, group.prefix, b, req.seed, i, group.max_new_tokens, dest=dest
        )
        self._slots[b] = _Live(req, i, group.max_new_tokens, context=req.prompt_tokens)

    # ----- preemption -----

    def _preempt(self, b: int) -> None:
        live = self._slots[b]
        live.preempted = True
        self._free_slot(b)
        self._state = self.engine.release(self._state, [b])
        # An extended turn restarts from its whole context (earlier turns and observations as its prompt).
        request = live.request
        if len(live.context) != len(request.prompt_tokens):
            request = dataclasses.replace(request, prompt_tokens=live.context)
        restart = _Group(request, live.max_new_tokens, collections.deque([live.sample_index]))
        self._groups.appendleft(restart)
        self.stats.preemptions += 1

    def _free_slot(self, b: int) -> None:
        self._slots[b] = None
        self._planner.release(b)

    def _flush_into(self, out: list) -> None:
        if self._pending is not None:
            out += self._process(*self._pending)
            self._pending = None

    def _release_finished(self, rnd: Round, owners: list) -> None:
        """Frees the slots whose sequence ended in `rnd` (waits for it; reads only its `done` flags).

        Refilling them before `rnd`'s tokens are parsed keeps them busy in the next call: releasing them
        only after parsing left each finished slot idle for one whole call (with 4 steps per call and
        short answers that lost more than the overlap of host work won; docs/sampler.md).
        """
        done = np.asarray(rnd.done)
        for b, live in enumerate(owners):
            if live is not None and done[b] and self._slots[b] is live and not live.request.park:
                self._free_slot(b)

    def _process(self, rnd: Round, owners: list) -> list[Completion]:
        tokens, logp, slogp = (
            np.asarray(rnd.tokens),
            np.asarray(rnd.logprobs),
            np.asarray(rnd.sample_logprobs),
        )
        valid, done = np.asarray(rnd.valid), np.asarray(rnd.done)
        self.stats.tokens_generated += int(valid.sum())
        self.stats.slot_steps += valid.size
        out = []
        for b, live in enumerate(owners):
            if live is None or live.finished or live.preempted:
                continue
            m = valid[:, b]
            live.tokens += tokens[m, b].tolist()
            live.logprobs += logp[m, b].tolist()
            live.sample_logprobs += slogp[m, b].tolist()
            live.versions += [rnd.version] * int(m.sum())
            if done[b]:
                live.finished = True
                if live.request.park and self._slots[b] is live:
                    live.parked = True
                    self._parked[(live.request.uid, live.sample_index)] = b
                    self._planner.park(b)
                elif self._slots[b] is live:
                    self._free_slot(b)
                out.append(self._completion(live))
        self.stats.completions += len(out)
        return out

    def _completion(self, live: _Live) -> Completion:
        reason = "stop" if live.tokens and live.tokens[-1] in self._stop else "length"
        r = live.request
        return Completion(
            uid=r.uid,
            sample_index=live.sample_index,
            prompt_tokens=r.prompt_tokens,
            tokens=np.asarray(live.tokens, np.int32),
            logprobs=np.asarray(live.logprobs, np.float32),
            sample_logprobs=np.asarray(live.sample_logprobs, np.float32),
            versions=np.asarray(live.versions, np.int64),
            finish_reason=reason,
            metadata=r.metadata,
            parked=live.parked,
        )
