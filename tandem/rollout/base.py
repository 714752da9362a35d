"""RolloutEngine: the contract every backend (builtin, paged, vLLM) keeps, and the one generate
skeleton they all run: the gate around it (one call at a time; an abort or a weight update from
other threads) and sleep / wake. docs/rollout.md, "One generate skeleton" and "Sleep and wake",
describes them.

Threads: `generate`, `apply_pending`, `load_weights`, `sleep` and the rng state come from one
thread, one call at a time; `set_pending_update` and `abort` from any thread at any moment.

An engine supplies only `_begin` (its `Generation`), `named_weights`, `device` and what sleeping
frees (`memory`). Nothing is copied back on wake, so generating before a weight push has refilled
the weights is an error, never garbage tokens.
"""

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
from torch import Tensor

from tandem import heap
from tandem.rollout.call import GenerateCall
from tandem.rollout.protocol import ON_UPDATE_POLICIES, StopCheck
from tandem.sample import Sample, SamplingParams


class Generation(Protocol):
    """One generate call inside an engine: its batch, cache and the tokens taken so far."""

    @property
    def done(self) -> bool: ...  # every sample has ended (or was stopped)

    def step(self) -> bool: ...  # a forward + sampling -> whether a token came (a prompt chunk: none)

    def stop(self, keys: set[tuple[int, int]]) -> None: ...  # those samples end now, ABORTED (again: no-op)

    def close(self) -> None: ...  # write every sample back; one that has not ended is ABORTED

    def swap(self, apply: Callable[[], int | None]) -> None:
        """Under "continue": apply() between two steps; cached keys stay as the old weights made them."""
        apply()


class RolloutEngine:
    """Generates responses and takes new weights, between calls or (per policy) in the middle.

    eos_token_ids: end responses (with the call's stop ids).
    on_update: what a running call does with an update that arrives mid-call: "drain" finishes on
        the old weights, "abort" returns partials, "continue" swaps the weights between two steps.
    on_step: a test hook called between steps with the number of steps that produced tokens (1, 2,
        ...), just before the checks for an abort or an update.
    detokenizes: the engine finds stop strings in text itself (vLLM): `params.stop` needs no check.
    """

    detokenizes = False

    def __init__(
        self, eos_token_ids: list[int], version: int, on_update: str, on_step: Callable[[int], None] | None
    ):
        if on_update not in ON_UPDATE_POLICIES:
            raise ValueError(f"on_update={on_update!r}; valid: {', '.join(ON_UPDATE_POLICIES)}")
        self.eos_token_ids = list(eos_token_ids)
        self.on_update, self.on_step = on_update, on_step
        self._version = version
        self._lock = threading.Lock()  # guards the four fields below, shared with other threads
        self._pending: tuple[int, Callable[[], None]] | None = None
        self._running = self._abort_requested = False
        self._aborted: set[tuple[int, int]] = set()  # `Sample.key` of the samples abort() named
        self.asleep = False
        self._needs_push = False  # woke up: the weights hold nothing until an update is applied
        self.last_wake_s = 0.0
        self.memory = Storages([])  # what sleep frees: the engine fills it

    @property
    def version(self) -> int:
        """The policy version of the weights the engine now serves."""
        return self._version

    def named_weights(self) -> Mapping[str, Tensor]:
        """The tensors, by Hugging Face name with the trainer's shapes and dtypes, that an update's
        `apply()` writes into: the live parameters, or buffers the engine loads from (vLLM). In a
        LoRA run, only what a push carries: the adapters (`tandem.model.lora.adapter_shapes`)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the engine's weights live (sleep hands CUDA memory back to the driver)."""
        raise NotImplementedError

    def _begin(self, samples: list[Sample], call: GenerateCall) -> Generation:
        raise NotImplementedError

    def _check_params(self, params: SamplingParams) -> None:
        """ValueError for sampling this engine cannot do (every engine does all of it but vLLM)."""

    def _after_update(self) -> None:
        """Runs once an update's weights are in `named_weights()`, before its version is served."""

    def _on_sleep(self) -> None:
        """Runs before `memory` is freed: drop what points into it."""

    def _on_wake(self) -> None:
        """Runs once `memory` is back (its contents undefined)."""

    def rng_state(self) -> Tensor | None:
        """While idle: the state of the stream unseeded requests draw from, for a checkpoint; None
        when the engine cannot restore it."""
        return None

    def set_rng_state(self, state: Tensor) -> None:
        """While idle: continue that stream from a state `rng_state` returned."""
        raise NotImplementedError

    # -- generate ------------------------------------------------------------------------------------
    def generate(
        self, samples: list[Sample], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> list[Sample]:
        """Extend each sample's response to its end and return the same list, on the newest weights
        (a pending update is applied first). A partial response (from an aborted call) is continued,
        to at most `max_new_tokens` in all. Each new token is APPENDED to response_ids, logprobs
        (per `params.logprobs_mode`), versions (of the weights whose forward gave its logits) and
        loss_mask (1). A sample ends FINISHED ("stop", "length") or, when `abort()` or an update
        under "abort" stopped the call, ABORTED ("abort") with the tokens it has so far.

        `stop_check` ends responses on `params.stop` as they decode; an engine that detokenizes
        (vLLM) may ignore it, one that does not raises ValueError when `params.stop` comes alone.
        """
        call = GenerateCall.check(samples, params, stop_check, self.eos_token_ids, self.detokenizes)
        self._check_params(params)
        with self._lock:
            if self._running:
                raise RuntimeError("generate() is already running; calls must come one at a time")
            self._running = True
        try:
            self._apply_pending()  # a new call always starts on the newest weights
            if self.asleep or self._needs_push:
                raise RuntimeError(
                    "generate() on an engine that slept: its weights were freed and no weight "
                    "update has refilled them since (push weights, or load_weights, first)."
                )
            todo = [s for s in samples if call.needs_tokens(s)]
            if todo:
                with heap.reusing():  # a step's tensors in the last step's memory; trimmed after
                    self._drive(self._begin(todo, call))
        finally:
            with self._lock:
                # An abort() that came too late to stop this call must not stop the next one.
                self._running, self._abort_requested, self._aborted = False, False, set()
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
                with self._lock:
                    pending = self._pending is not None
                    if self._abort_requested or (pending and self.on_update == "abort"):
                        break
                    aborted = set(self._aborted)  # abort(samples): only they stop
                if aborted:
                    generation.stop(aborted)
                if pending and self.on_update == "continue":
                    generation.swap(self._apply_pending)
        finally:
            generation.close()

    def abort(self, samples: Iterable[Sample] | None = None) -> None:
        """The running generate call stops at its next step and returns its unfinished samples
        ABORTED with their partial responses; with `samples` (matched by `Sample.key`) only those
        stop. No-op when no call runs; it never carries over to a later call."""
        with self._lock:
            if not self._running:
                return
            if samples is None:
                self._abort_requested = True
            else:
                self._aborted.update(s.key for s in samples)

    # -- weight updates ------------------------------------------------------------------------------
    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        """`apply()` copies staged weights of `version` into `named_weights()`, once, on the
        generating thread: at the next generate call, at `apply_pending()`, or between two steps
        under "continue". A later call replaces an update not yet applied. The staged weights must
        not change until it has run (receive the next version into another buffer)."""
        with self._lock:
            self._pending = (version, apply)

    def apply_pending(self) -> int | None:
        """While idle: apply the pending update now -> its version, or None when none was pending."""
        self._check_idle("apply_pending()")
        return self._apply_pending()

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """While idle: copy these parameters (Hugging Face names) in now and serve `version`; it
        replaces any pending update."""
        targets = self.named_weights()

        def apply() -> None:
            for name, tensor in named_tensors:
                targets[name].copy_(tensor)

        self.set_pending_update(version, apply)
        self.apply_pending()

    def _check_idle(self, what: str) -> None:
        with self._lock:
            if self._running:
                raise RuntimeError(f"{what} was called while generate() is running")

    def _apply_pending(self) -> int | None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        version, apply = pending
        self.wake()
        # Outside inference mode, so tensors that apply() creates stay ordinary tensors.
        with torch.inference_mode(False), torch.no_grad():
            apply()
            self._after_update()
        self._version, self._needs_push = version, False
        return version

    # -- sleep and wake ------------------------------------------------------------------------------
    def sleep(self) -> dict[str, float]:
        """While idle: free the weights and the KV cache -> {"memory/engine_bytes": bytes freed,
        "perf/sleep_s": its seconds, "perf/wake_s": the seconds of the wake before it}. The next
        update applied (by generate, `apply_pending` or `load_weights`) wakes it."""
        self._check_idle("sleep()")
        if self.asleep:
            return {"memory/engine_bytes": 0.0, "perf/sleep_s": 0.0, "perf/wake_s": 0.0}
        start = time.perf_counter()
        freed = self.engine_bytes()
        self._on_sleep()
        self.memory.free()
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
        self.memory.restore()
        self._on_wake()
        self.asleep, self._needs_push = False, True
        self.last_wake_s = time.perf_counter() - start

    def engine_bytes(self) -> int:
        """Bytes of the weights and KV cache this engine holds now (0 asleep)."""
        return self.memory.nbytes


class Storages:
    """Frees tensors' memory and brings it back while every tensor object, view and parameter stays
    the one it was (what FSDP does with its unsharded parameters): a weight update by name, or a
    module holding a view, needs no re-wiring after a wake."""

    def __init__(self, tensors: Iterable[Tensor]):
        unique = {(s := t.untyped_storage()).data_ptr(): s for t in tensors}  # views share a storage
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
