"""UpdateGate: one generate call at a time, what other threads ask of it (an abort, a pending weight
update), and the version served. `base.Engine` builds the generate skeleton on it."""

import threading
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from tandem.rollout.protocol import ON_UPDATE_POLICIES
from tandem.sample import Sample


class UpdateGate:
    """`RolloutEngine`'s methods around generate (their contracts are there); `abort` and
    `set_pending_update` are thread-safe.

    on_update: what a running call does with an update that arrives mid-call: "drain" finishes on
        the old weights, "abort" returns partials, "continue" swaps the weights between two steps.
    on_step: a test hook called between steps with the number of steps taken (1, 2, ...), just
        before the checks for an abort or an update.
    """

    def __init__(self, version: int, on_update: str, on_step: Callable[[int], None] | None):
        if on_update not in ON_UPDATE_POLICIES:
            raise ValueError(f"on_update={on_update!r}; valid: {', '.join(ON_UPDATE_POLICIES)}")
        self.on_update, self.on_step = on_update, on_step
        self._version = version
        self._lock = threading.Lock()  # guards the fields below, shared with other threads
        self._pending: tuple[int, Callable[[], None]] | None = None
        self._running = False
        self._abort_requested = False
        self._aborted: set[tuple[int, int]] = set()  # `Sample.key` of the samples abort() named

    @property
    def version(self) -> int:
        return self._version

    def named_weights(self) -> Mapping[str, Tensor]:
        raise NotImplementedError

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        with self._lock:
            self._pending = (version, apply)

    def apply_pending(self) -> int | None:
        with self._lock:
            if self._running:
                raise RuntimeError("apply_pending() was called while generate() is running")
        return self._apply_pending()

    def abort(self, samples: Iterable[Sample] | None = None) -> None:
        with self._lock:
            if not self._running:
                return
            if samples is None:
                self._abort_requested = True
            else:
                self._aborted.update(s.key for s in samples)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
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
            self._running = True

    def _leave(self) -> None:
        with self._lock:
            # An abort() that came too late to stop this call must not stop the next one.
            self._running, self._abort_requested, self._aborted = False, False, set()

    def _aborted_samples(self) -> set[tuple[int, int]]:
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
        """abort() was called, or an update is pending under "abort"."""
        with self._lock:
            return self._abort_requested or (self._pending is not None and self.on_update == "abort")

    def _swap_now(self) -> bool:
        """An update is pending under "continue": swap it in before the next step."""
        with self._lock:
            return self._pending is not None and self.on_update == "continue"
