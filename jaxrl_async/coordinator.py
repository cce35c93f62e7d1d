"""The coordinator: the one place with global state — the η admission budget, the data cursor and the
prompts in flight.

Actors ask it for prompts (`TicketRequest`, a number of prompts they could start); it grants what AReaL's
rule allows (the n-th prompt starts only while floor((n - 1) / B) <= trained version + η) and remembers
what is left of each actor's demand, so that a request the bound refused is granted as soon as the learner
reports a new version (`Trained`). Because every prompt of every actor passes through this one counter, η
holds for the whole run, however many sampler replicas there are.

It lives on the learner lead's process, beside the learner, and talks only through the transport.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxrl_async.rollouts import StalenessController
from jaxrl_async.transport import TicketRequest, Tickets, Trained

log = logging.getLogger(__name__)


class Coordinator:
    """Grants prompts under the staleness bound; see the module docstring.

    Args:
      prompts: the data iterator (a grain DatasetIterator with get_state/set_state).
      batch_prompts: B, prompts per train batch.
      eta: the staleness bound (0 = synchronous).
      transport: the run's transport (this role reads the "coordinator" endpoint).
      version: the trained policy version the run starts at.
      state: a `state()` snapshot to resume from (the data cursor and the admission count).
    """

    endpoint = "coordinator"

    def __init__(self, prompts, batch_prompts: int, eta: int, transport, version: int = 0, state=None):
        self.prompts, self.transport = prompts, transport
        self.controller = StalenessController(batch_prompts, eta)
        self.version = version
        self.in_flight: dict[int, str] = {}  # group id -> prompt uid, admitted and not yet trained
        self.demand: dict[int, int] = {}  # actor -> prompts it asked for and has not been granted
        self.exhausted = False
        self.max_ahead = 0  # the most versions admission ever ran ahead of training (<= eta)
        if state is not None:
            self.prompts.set_state(state["data"])
        # Prompts in flight when the snapshot was taken are not restored: admission restarts from the
        # trained version (their budget is returned, the data cursor has passed them).
        self.controller.started = version * batch_prompts

    def poll(self) -> bool:
        """Handles every waiting message; True if there was any."""
        messages = self.transport.recv(self.endpoint)
        for m in messages:
            if isinstance(m, TicketRequest):
                self.demand[m.actor] = self.demand.get(m.actor, 0) + m.n
            elif isinstance(m, Trained):
                self.version = max(self.version, m.version)
                for gid in m.group_ids:
                    self.in_flight.pop(gid, None)
            else:
                raise TypeError(f"coordinator: unexpected message {type(m).__name__}")
        if messages:
            self._grant()
        return bool(messages)

    def _grant(self) -> None:
        for actor, want in list(self.demand.items()):
            granted = []
            while len(granted) < want and not self.exhausted and self.controller.can_admit(self.version):
                prompt = next(self.prompts, None)
                if prompt is None:
                    self.exhausted = True
                    break
                gid = self.controller.admit(self.version)
                self.in_flight[gid] = prompt.uid
                granted.append((gid, prompt))
            if granted or self.exhausted:
                self.demand[actor] = want - len(granted)
                self.max_ahead = max(self.max_ahead, self.controller.ahead(self.version))
                self.transport.send(f"actor:{actor}", Tickets(granted, self.exhausted))

    def describe(self) -> str:
        return (
            f"coordinator: version {self.version}, {self.controller.started} prompts started, "
            f"{len(self.in_flight)} in flight, demand {self.demand}"
            + (", data exhausted" if self.exhausted else "")
        )

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the data cursor and the admission count."""
        return {"data": self.prompts.get_state(), "started": self.controller.started, "version": self.version}

    def summary(self) -> dict[str, Any]:
        return {"max_admission_ahead": self.max_ahead, "prompts_started": self.controller.started}
