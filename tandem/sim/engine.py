"""A simulated inference engine: continuous batching of decoding sequences, in closed form.

The running sequences decode together, one token each per step; a step of n sequences whose
contexts sum to C tokens takes `a(n) + c·C` (`tandem.sim.costs`). Between two events (a sequence
ends, one enters) n is fixed and C grows by n per step, so k steps take

    T(k) = k·a(n) + c·(k·C + n·k²/2)

and the time to the next event, or the steps made in a given time, come from that quadratic
without stepping through the tokens. Every running sequence advances by the same k, so each is
kept under the step count at which it ends (`mark`): the next to end is the heap's top. A waiting
sequence enters as soon as fewer than `max_seqs` run and its context fits the KV cache, and its
prefill (prompt, plus its partial response when it continues one) delays the decoding of all.
"""

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from tandem.sample import Sample
from tandem.sim.costs import Costs

INF = float("inf")
EPS = 1e-6  # steps: a sequence this close to its end has ended (the clock's rounding)


@dataclass(eq=False)
class Seq:
    """One sample decoding in the engine."""

    sample: Sample
    owner: Any  # the generate call it belongs to
    target: int  # its response's length when it ends
    done: float  # response tokens so far (as of when it entered, while running)
    context: float  # prompt and response tokens so far (likewise)
    prefill: float  # tokens to prefill when it enters
    entered: float = 0.0  # the engine's step count when it entered
    running: bool = False


class Engine:
    def __init__(self, costs: Costs, devices: float, max_seqs: int, kv_tokens: float):
        self.costs, self.devices, self.max_seqs, self.kv_tokens = costs, devices, max_seqs, kv_tokens
        self.kv = costs.kv_s_per_token(devices)  # c
        self._fixed: dict[int, float] = {}  # a(n), by n
        self.steps = 0.0  # decode steps every running sequence has made since the engine started
        self.heap: list[tuple[float, int, Seq]] = []  # (the step count it ends at, order, seq)
        self.n = 0  # running sequences (the heap also holds removed ones, lazily)
        self.waiting: deque[Seq] = deque()
        self.context = 0.0  # C: the running sequences' contexts, summed
        self.stall = 0.0  # prefill seconds before decoding goes on
        self.version = 0  # the weights' version new tokens come from
        self._order = itertools.count()

    def add(self, seqs: list[Seq], stall: float = 0.0) -> None:
        self.stall += stall
        self.waiting.extend(seqs)
        self._admit()

    def busy(self) -> bool:
        return bool(self.n or self.waiting)

    def until_next(self) -> float:
        """Seconds until the next sequence ends; INF when none runs."""
        if not self.n:
            return INF
        return self.stall + self._time(max(self._top() - self.steps, 0.0))

    def advance(self, dt: float) -> list[Seq]:
        """Decode for `dt` seconds -> the sequences that ended (and left the engine)."""
        used = min(self.stall, dt)
        self.stall -= used
        dt -= used
        if dt > 0 and self.n:
            k = min(self._steps(dt), max(self._top() - self.steps, 0.0) + EPS)
            self.steps += k
            self.context += k * self.n
        ended = []
        while self.n and self._top() <= self.steps + EPS:
            s = heapq.heappop(self.heap)[2]
            s.running = False
            s.done, s.context = float(s.target), self._context(s)
            self.n -= 1
            self.context -= s.context
            ended.append(s)
        self._settle()
        return ended

    def take(self, owners: set) -> list[Seq]:
        """Abort: the sequences of these calls leave the engine now, with what they have."""
        out = [s for _, _, s in self.heap if s.running and s.owner in owners]
        for s in out:
            s.done, s.context = self._done(s), self._context(s)
            s.running = False
            self.n -= 1
            self.context -= s.context
        out += [s for s in self.waiting if s.owner in owners]
        self.waiting = deque(s for s in self.waiting if s.owner not in owners)
        self.heap = [e for e in self.heap if e[2].running]
        heapq.heapify(self.heap)
        self._settle()
        return out

    def swap(self, version: int) -> None:
        """New weights between two steps: the running sequences' next tokens come from them."""
        self.version = version
        for _, _, s in self.heap:
            if s.running:
                _note_version(s.sample, version)

    def progress(self, s: Seq) -> float:
        """Response tokens `s` has now."""
        return self._done(s) if s.running else s.done

    # -- the closed forms ------------------------------------------------------------------------------
    def _top(self) -> float:
        while not self.heap[0][2].running:  # removed by an abort
            heapq.heappop(self.heap)
        return self.heap[0][0]

    def _done(self, s: Seq) -> float:
        return min(s.done + self.steps - s.entered, float(s.target))

    def _context(self, s: Seq) -> float:
        return s.context + (self._done(s) - s.done)

    def _a(self) -> float:
        if self.n not in self._fixed:
            self._fixed[self.n] = self.costs.decode_step_fixed(self.n, self.devices)
        return self._fixed[self.n]

    def _time(self, k: float) -> float:
        return k * self._a() + self.kv * (k * self.context + self.n * k * k / 2)

    def _steps(self, t: float) -> float:
        """The k with T(k) = t: A·k² + B·k = t, A = c·n/2, B = a + c·C."""
        a, b = self.kv * self.n / 2, self._a() + self.kv * self.context
        return 2 * t / (b + math.sqrt(b * b + 4 * a * t))

    def _settle(self) -> None:
        if not self.n:
            self.heap, self.context, self.stall = [], 0.0, 0.0  # no drift from float sums
        self._admit()

    def _admit(self) -> None:
        while self.waiting and self.n < self.max_seqs:
            s = self.waiting[0]
            if self.n and self.context + s.context > self.kv_tokens:
                return  # it waits for memory, as a paged engine's scheduler makes it
            self.waiting.popleft()
            s.entered, s.running = self.steps, True
            heapq.heappush(self.heap, (self.steps + s.target - s.done, next(self._order), s))
            self.n += 1
            self.context += s.context
            self.stall += self.costs.prefill_s(s.prefill, self.devices)
            if s.target > s.done:
                _note_version(s.sample, self.version)


def _note_version(sample: Sample, version: int) -> None:
    """The simulator's samples keep one entry per policy version their tokens came from, in order
    (not one per token): staleness needs only the oldest."""
    if not sample.versions or sample.versions[-1] != version:
        sample.versions.append(version)
