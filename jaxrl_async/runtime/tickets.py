"""An actor's ticket book: the prompts it asked the coordinator for, those granted (each a sampler
`Request` of G samples), how many to keep queued beyond the free slots, and whether the data ran out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from jaxrl_async.run_config import Schedule
from jaxrl_async.runtime.messages import Tickets
from jaxrl_async.sampler import Request

log = logging.getLogger(__name__)


class TicketBook:
    """Prompt grants for one actor (see the module docstring).

    Args:
      index: the actor's number (for the log).
      seed: the run's seed (each prompt's sampling stream derives from it and the group id).
      schedule: the run's Schedule (samples_per_prompt = G; prompts_per_step sizes the lookahead).
      num_slots: the sampling engine's slots.
      actors: how many actors share the run's prompts (this one's share of a step sizes its queue).
      max_new_tokens_fn: optional group id -> generation cap (benchmarks impose a length distribution).
    """

    def __init__(self, index: int, seed: int, schedule: Schedule, num_slots: int, actors: int,
                 max_new_tokens_fn: Callable[[int], int] | None = None):  # fmt: skip
        self.seed, self.samples = seed, schedule.samples_per_prompt
        self.max_new_tokens_fn = max_new_tokens_fn
        # Prompts to keep queued beyond the free slots: two engines' worth plus this actor's share of a
        # step. The coordinator answers from the learner's process, whose train step holds its cores, so
        # an answer can come a step late and the queue must outlast that step. On letter_range a quarter
        # of an engine left the trainer idle 31% of the time, two engines 16-19%, and two engines plus a
        # step 4-7.5% (pinned, and with the sampler's core lent to the learner; docs/history/): with
        # less the sampler never got a whole step ahead, whatever η allowed. The η bound still caps what
        # is granted: this changes when prompts start, not how stale they may be.
        engines = math.ceil(2 * num_slots / self.samples)
        self.lookahead = max(1, engines + math.ceil(schedule.prompts_per_step / actors))
        log.info("actor %d: keeps %d prompts queued beyond its free slots", index, self.lookahead)
        self.granted = 0  # prompts granted so far
        self.asked = 0  # prompts asked for and not yet granted
        self.exhausted = False  # the coordinator has no more prompts
        self._drained_sent = False  # a report saying this actor has nothing left went out since a grant

    def grant(self, tickets: Tickets) -> list[Request]:
        """Books a grant; the sampler requests of its prompts (the prompt record is each one's metadata)."""
        self.exhausted = tickets.exhausted
        self._drained_sent = False
        self.asked = max(0, self.asked - len(tickets.prompts))
        self.granted += len(tickets.prompts)
        return [
            Request(
                uid=gid,
                prompt_tokens=tuple(int(t) for t in prompt.tokens),
                n_samples=self.samples,
                seed=self.seed * 1_000_003 + gid,
                max_new_tokens=self.max_new_tokens_fn(gid) if self.max_new_tokens_fn else None,
                metadata=prompt,
            )
            for gid, prompt in tickets.prompts
        ]

    def queued(self, admitted: int) -> int:
        """Prompts granted and not yet admitted by the sampler (`admitted`: its requests admitted)."""
        return self.granted - admitted

    def want(self, free_slots: int, admitted: int) -> int:
        """How many more prompts to ask for to fill the free slots plus the lookahead (booked as asked);
        0 once the data is exhausted."""
        if self.exhausted:
            return 0
        want = math.ceil(free_slots / self.samples) + self.lookahead - self.queued(admitted) - self.asked
        if want <= 0:
            return 0
        self.asked += want
        return want

    def report_due(self, groups_ready: bool, drained: bool) -> bool:
        """Whether to send a report now: groups are ready, or the actor just drained (once per grant)."""
        if groups_ready or (drained and not self._drained_sent):
            self._drained_sent = drained
            return True
        return False
