"""Batching an OpenAI agent's requests: the episodes of a generate call run side by side on one
asyncio loop (a thread of the worker), the one the endpoint's server runs on; their requests wait
here, and the worker's own thread serves them as one engine call once every episode still running
is waiting for the model (or no request has arrived for `BATCH_WAIT_S`, so an episode busy with a
slow tool does not hold up the others). So many concurrent episodes share one batch, on whichever
engine the run uses."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.agent.chains import Episode, Served
from tandem.agent.openai_request import Request
from tandem.sample import Sample

BATCH_WAIT_S = 0.05  # a pause in arrivals this long ends a batch while served episodes are busy
FIRST_WAIT_S = 5.0  # the longest a request waits for episodes yet to make their first request


@dataclass(eq=False)  # compared by identity, as Episode
class Pending:
    """A request waiting for the engine: one engine sample per choice."""

    request: Request
    episode: Episode
    prompt_ids: list[int]
    parent: Served | None  # the choice it extends, None for a fresh chain
    context: list[int]  # ids between the parent's completion and this generation
    samples: list[Sample]
    since: float
    answer: asyncio.Future  # on the endpoint's loop: (choices, prompt tokens), or the BadRequest


class Batcher:
    """The requests waiting for the engine, from every episode of the worker: `put` from the
    endpoint's loop, `next_batch` on the worker's thread."""

    def __init__(self, cond: threading.Condition):
        self.cond = cond  # the agent's (re-entrant): it guards the episodes too
        self.pending: list[Pending] = []
        self.arrived = 0.0  # when the last request arrived

    def waiting(self, ep: Episode) -> int:
        """How many of `ep`'s requests wait."""
        with self.cond:
            return sum(1 for p in self.pending if p.episode is ep)

    def put(self, p: Pending) -> None:
        with self.cond:
            self.pending.append(p)
            self.arrived = time.monotonic()
            self.cond.notify_all()

    def put_back(self, batch: list[Pending]) -> None:
        """Requests a weight update cut short: served again, on the new weights."""
        with self.cond:
            self.pending.extend(batch)

    def next_batch(
        self, episodes: list[Episode], timeout_s: float, hung: Callable[[Episode], None]
    ) -> list[Pending] | None:
        """The requests of `episodes` to serve now; None once every episode has ended. Serve when
        every episode still running waits for the model; else, when only episodes that were served
        before are busy (in a tool, say) and no request has arrived for BATCH_WAIT_S; an episode
        that has not made its first request yet is waited for up to FIRST_WAIT_S (a quarter of the
        episode's time limit `timeout_s`, if that is less). `hung(ep)` ends an episode past its
        deadline (it must set `ep.ended`)."""
        with self.cond:
            while True:
                now = time.monotonic()
                for ep in episodes:  # a hung agent: give up on it
                    if not ep.ended and now > ep.deadline + 1.0:
                        hung(ep)
                live = [ep for ep in episodes if not ep.ended and not ep.future.done()]
                mine = [p for p in self.pending if p.episode in episodes]
                waiting = {p.episode.id for p in mine}
                idle = [ep for ep in live if ep.id not in waiting]
                starting = any(not ep.calls for ep in idle)
                if mine and (
                    not idle
                    or (not starting and now - self.arrived >= BATCH_WAIT_S)
                    or now - min(p.since for p in mine) >= min(FIRST_WAIT_S, timeout_s / 4)
                ):
                    self.pending = [p for p in self.pending if p not in mine]
                    return mine
                if not live and not mine:
                    return None
                self.cond.wait(BATCH_WAIT_S / 2)
