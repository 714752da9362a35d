"""Engine: the one generate skeleton every engine runs, and sleep / wake (docs/rollout.md, "One
generate skeleton", "Sleep and wake").

An engine supplies only `_begin` (its `Generation`), `named_weights`, `device` and what sleeping
frees (`memory`). Sleep frees the weights and KV cache while the trainer uses the device; nothing
is copied back on wake, so generating before a weight push has refilled them is an error, never
garbage tokens.
"""

import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import Tensor

from tandem.rollout.call import GenerateCall
from tandem.rollout.gate import UpdateGate
from tandem.rollout.protocol import SamplingParams, StopCheck
from tandem.sample import Sample


class Generation(Protocol):
    """One generate call inside an engine: its batch, cache and the tokens taken so far."""

    @property
    def done(self) -> bool:
        """Every sample has ended (or was stopped)."""
        ...

    def step(self) -> bool:
        """One engine step (a forward, the sampling, the bookkeeping) -> whether any token came
        (a chunk of a long prompt gives none)."""
        ...

    def stop(self, keys: set[tuple[int, int]]) -> None:
        """The samples whose `key` is in `keys` end now, ABORTED with what they have. Called again
        with the keys of earlier calls: stopping a sample twice is a no-op."""
        ...

    def swap(self, apply: Callable[[], int | None]) -> None:
        """Under "continue": `apply()` swaps the pending weights in under the running sequences;
        their next tokens record its version."""
        ...

    def close(self) -> None:
        """Write each sample's new tokens back to it; one that has not ended is ABORTED."""
        ...


class Engine(UpdateGate):
    """The skeleton; `eos_token_ids` end responses (with the call's stop ids).

    detokenizes: the engine finds stop strings in text itself (vLLM), so a call with `params.stop`
        needs no `StopCheck`.
    """

    detokenizes = False

    def __init__(
        self, eos_token_ids: list[int], version: int, on_update: str, on_step: Callable[[int], None] | None
    ):
        super().__init__(version, on_update, on_step)
        self.eos_token_ids = list(eos_token_ids)
        self.asleep = False
        self._needs_push = False  # woke up: the weights hold nothing until an update is applied
        self.last_wake_s = 0.0
        self.memory = Storages([])  # what sleep frees: the engine fills it

    def generate(
        self, samples: list[Sample], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> list[Sample]:
        call = GenerateCall.check(samples, params, stop_check, self.eos_token_ids, self.detokenizes)
        self._check_params(params)
        self._enter()
        try:
            self._apply_pending()  # a new call always starts on the newest weights
            if self.asleep or self._needs_push:
                raise RuntimeError(
                    "generate() on an engine that slept: its weights were freed and no weight "
                    "update has refilled them since (push weights, or load_weights, first)."
                )
            todo = [s for s in samples if call.needs_tokens(s)]
            if todo:
                self._drive(self._begin(todo, call))
        finally:
            self._leave()
        return samples

    def _drive(self, generation: Generation) -> None:
        steps = 0  # steps that produced tokens
        try:
            while not generation.done:
                produced = generation.step()
                if generation.done:
                    break
                if produced:
                    steps += 1
                    if self.on_step is not None:
                        self.on_step(steps)
                if self._must_stop():
                    break
                if aborted := self._aborted_samples():  # abort(samples): only they stop
                    generation.stop(aborted)
                if self._swap_now():
                    generation.swap(self._apply_pending)
        finally:
            generation.close()

    def _begin(self, samples: list[Sample], call: GenerateCall) -> Generation:
        raise NotImplementedError

    def _check_params(self, params: SamplingParams) -> None:
        """ValueError for sampling this engine cannot do (every engine does all of it but vLLM)."""

    def rng_state(self) -> Tensor | None:
        return None  # this engine cannot restore the stream unseeded requests draw from

    def set_rng_state(self, state: Tensor) -> None:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the engine's weights live (sleep hands CUDA memory back to the driver)."""
        raise NotImplementedError

    # -- sleep and wake ------------------------------------------------------------------------------
    def sleep(self) -> dict[str, float]:
        """While idle: free the weights and the KV cache -> {"memory/engine_bytes": bytes freed,
        "perf/sleep_s": its seconds, "perf/wake_s": the seconds of the wake before it}. The next
        generate call, `apply_pending` or `load_weights` wakes it."""
        with self._lock:
            if self._running:
                raise RuntimeError("sleep() was called while generate() is running")
        if self.asleep:
            return {"memory/engine_bytes": 0.0, "perf/sleep_s": 0.0, "perf/wake_s": 0.0}
        start = time.perf_counter()
        freed = self._release()
        if self.device.type == "cuda":  # hand the memory back to the driver, for another process
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.asleep = True
        seconds = time.perf_counter() - start
        return {"memory/engine_bytes": float(freed), "perf/sleep_s": seconds, "perf/wake_s": self.last_wake_s}

    def wake(self) -> None:
        """Re-allocate what sleep freed, with undefined contents until the next update is applied."""
        if not self.asleep:
            return
        start = time.perf_counter()
        self._restore()
        self.asleep, self._needs_push = False, True
        self.last_wake_s = time.perf_counter() - start

    def engine_bytes(self) -> int:
        """Bytes of the weights and KV cache this engine holds now (0 asleep)."""
        return self.memory.nbytes

    def _release(self) -> int:
        """Free the weights and KV cache -> bytes freed."""
        return self.memory.free()

    def _restore(self) -> None:
        self.memory.restore()

    def _apply_pending(self) -> int | None:
        if self.asleep and self._has_pending():
            self.wake()
        version = super()._apply_pending()
        if version is not None:
            self._needs_push = False
        return version


class Storages:
    """Frees tensors' memory and brings it back while every tensor object, view and parameter stays
    the one it was (what FSDP does with its unsharded parameters): a weight update by name, or a
    module holding a view, needs no re-wiring after a wake."""

    def __init__(self, tensors: Iterable[Tensor]):
        unique = {}
        for t in tensors:
            storage = t.untyped_storage()
            unique.setdefault(storage.data_ptr(), storage)
        self.storages = list(unique.values())
        self.sizes = [s.nbytes() for s in self.storages]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def free(self) -> int:
        held = self.nbytes
        for s in self.storages:
            s.resize_(0)
        return held

    def restore(self) -> None:
        for s, size in zip(self.storages, self.sizes, strict=True):
            s.resize_(size)
