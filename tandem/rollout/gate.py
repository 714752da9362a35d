"""UpdateGate: what every engine shares around its generate loop — one call at a time, an abort
request and a pending weight update from other threads, and the version it serves.

`tandem.rollout.base.Engine` builds the generate skeleton on it: it checks `_must_stop()` and
`_swap_now()` between two steps. An engine returns the tensors updates write into from
`named_weights()` and overrides `_after_update()` for what its model needs once new weights are in
(drop a prefix cache, push buffers into vLLM). docs/rollout.md states the contract.
"""

import threading
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from tandem.rollout.protocol import ON_UPDATE_POLICIES
from tandem.sample import Sample


class UpdateGate:
    """Thread-safe `abort`, `set_pending_update`; the rest from the generating thread.

    on_update: what a running `generate` call does with a weight update that arrives mid-call —
        "drain" finishes on the old weights, "abort" returns partials, "continue" swaps the weights
        between two steps. Every call first applies whatever update is pending.
    on_step: a test hook the engine calls between steps with the number of steps taken (1, 2, ...),
        just before it checks for an abort or an update.
    """

    def __init__(self, version: int, on_update: str, on_step: Callable[[int], None] | None):
        if on_update not in ON_UPDATE_POLICIES:
            raise ValueError(f"on_update={on_update!r}; valid: {', '.join(ON_UPDATE_POLICIES)}")
        self.on_update, self.on_step = on_update, on_step
        self._version = version
        self._lock = threading.Lock()  # guards the three fields below, shared with other threads
        self._pending: tuple[int, Callable[[], None]] | None = None
        self._running = False
        self._abort_requested = False
        self._aborted: set[tuple[int, int]] = set()  # `Sample.key` of the samples abort() named

    @property
    def version(self) -> int:
        """The version of the weights the engine now serves."""
        return self._version

    def named_weights(self) -> Mapping[str, Tensor]:
        raise NotImplementedError

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        """Any thread: `apply()` will copy staged weights of `version` into `named_weights()`
        (replaces an earlier update not yet applied). It runs on the generating thread, per `on_update`."""
        with self._lock:
            self._pending = (version, apply)

    def apply_pending(self) -> int | None:
        """Generate thread, while idle: apply the pending update now -> its version, or None."""
        with self._lock:
            if self._running:
                raise RuntimeError("apply_pending() was called while generate() is running")
        return self._apply_pending()

    def abort(self, samples: Iterable[Sample] | None = None) -> None:
        """Any thread: the running generate call stops at its next step; no-op when idle.

        With `samples` (of the running call, matched by group_id and index), only they stop: they
        come back ABORTED with their partial responses while the rest of the call goes on."""
        with self._lock:
            if not self._running:
                return
            if samples is None:
                self._abort_requested = True
            else:
                self._aborted.update(s.key for s in samples)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """While idle: copy the parameters (Hugging Face names) in now; replaces any pending update."""
        targets = self.named_weights()

        def apply() -> None:
            for name, tensor in named_tensors:
                targets[name].copy_(tensor)

        self.set_pending_update(version, apply)
        self.apply_pending()

    def _after_update(self) -> None:
        """Runs once an update's weights are in `named_weights()`, before its version is served."""

    def _enter(self) -> None:
        with self._lock:
            if self._running:
                raise RuntimeError("generate() is already running; calls must come one at a time")
            self._running, self._abort_requested = True, False
            self._aborted = set()

    def _leave(self) -> None:
        with self._lock:
            # An abort() that came too late to stop this call must not stop the next one.
            self._running, self._abort_requested = False, False
            self._aborted = set()

    def _aborted_samples(self) -> set[tuple[int, int]]:
        """`Sample.key` of the samples of the running call that abort(samples) stopped so far."""
        with self._lock:
            return set(self._aborted)

    def _apply_pending(self) -> int | None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        version, apply = pending
        # Outside inference mode, so tensors that apply() creates stay ordinary tensors.
        with torch.inference_mode(False), torch.no_grad():
            apply()
            self._after_update()
        self._version = version
        return version

    def _has_pending(self) -> bool:
        with self._lock:
            return self._pending is not None

    def _must_stop(self) -> bool:
        """The running call must stop now: abort() was called, or an update is pending under "abort"."""
        with self._lock:
            return self._abort_requested or (self._pending is not None and self.on_update == "abort")

    def _swap_now(self) -> bool:
        """An update is pending under "continue": the engine applies it before its next step."""
        with self._lock:
            return self._pending is not None and self.on_update == "continue"
