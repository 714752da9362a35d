"""`RewardPool`: scores Samples in worker processes, one pebble task per sample, each with a timeout.

A reward function that raises, hangs or kills its process costs only the sample it was scoring:
that sample gets reward 0.0 and is counted in `reward/errors` or `reward/timeouts`; `score` itself
neither raises nor hangs because of it.

The code verifier starts a sandboxed subprocess per test from inside a worker, so one sample's
tests share the worker's per-sample `timeout_s`: they get a budget of `timeout_s` - 1 s (half of
`timeout_s` when that is under 2 s), each test at most `sandbox_timeout_s` of it, and the tests
left when the budget is spent count as timed out. So the verifier returns its partial score in
time rather than lose the whole sample to the pool's kill (were the worker killed, its sandbox
child would die with it: see `tandem.sandbox`). Set `timeout_s` >= tests x time per test + 1 s.
"""

import logging
import math
import multiprocessing
import time
import traceback
from concurrent.futures import TimeoutError
from functools import cache
from typing import TYPE_CHECKING

from pebble import ProcessExpired, ProcessFuture, ProcessPool

from tandem.reward.code import CodeLimits
from tandem.reward.user_fn import AutoReward, RewardFn, canonical_spec, load_reward_fn
from tandem.sample import Prompt, Sample

if TYPE_CHECKING:
    from tandem.config.schema import RewardConfig

log = logging.getLogger("tandem.reward")

_MAX_LOGGED = 8  # failures logged one by one per `score` call; the rest in one summary line
# Headroom per wave of tasks for the backstop deadline: a worker that ignores SIGTERM gets 3 s
# before pebble SIGKILLs it, and its replacement has to start.
_WAVE_SLACK_S = 5.0
# A sample's time the code verifier leaves unspent: the worker's own overhead and the last test's
# sandbox teardown.
_CODE_SLACK_S = 1.0


class RewardPool:
    """A process pool that sets `sample.reward` and `sample.reward_parts` in place.

    `fn` is a reward spec (see `load_reward_fn`): resolved here, so a bad name fails at startup,
    and again by name in each worker. Workers live across `score` calls; a killed one is replaced.
    `sandbox_timeout_s` and `sandbox_memory_mb` limit each test the code verifier runs.
    """

    def __init__(
        self,
        fn: str = "auto",
        num_workers: int = 2,
        timeout_s: float = 10.0,
        sandbox_timeout_s: float = 5.0,
        sandbox_memory_mb: int = 512,
    ):
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if not sandbox_timeout_s > 0:
            raise ValueError(f"reward sandbox_timeout_s must be > 0, got {sandbox_timeout_s}")
        if sandbox_memory_mb < 1:
            raise ValueError(f"reward sandbox_memory_mb must be >= 1, got {sandbox_memory_mb}")
        self.spec = canonical_spec(fn)
        budget_s = max(timeout_s - _CODE_SLACK_S, timeout_s / 2)
        self.code_limits = CodeLimits(sandbox_timeout_s, sandbox_memory_mb, budget_s)
        self.fn: RewardFn = load_reward_fn(self.spec, self.code_limits)
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._pool = self._start()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: "RewardConfig") -> "RewardPool":
        """The pool of a config's reward section."""
        return cls(cfg.fn, cfg.num_workers, cfg.timeout_s, cfg.sandbox_timeout_s, cfg.sandbox_memory_mb)

    def _start(self) -> ProcessPool:
        # "forkserver": the parent has torch imported and runs threads, and forking such a process
        # can deadlock a child on a lock some other thread held. The fork server is a clean,
        # single-threaded process started once, so replacing a worker killed on timeout costs a
        # fork rather than spawn's fresh interpreter and re-imports. Measured: both start 2
        # workers in ~0.1 s here. Where forkserver is unavailable (Windows), spawn.
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        pool = ProcessPool(
            max_workers=self.num_workers,
            initializer=_warm_worker,
            initargs=(self.spec, self.code_limits),
            context=multiprocessing.get_context(method),
        )
        # pebble starts its workers on the first task; start them now, so that the fork server's
        # start (which re-imports the main module, e.g. torch: ~1.5 s) overlaps the caller's setup.
        pool.schedule(_ping)
        return pool

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Score every sample in place; returns {"reward/errors": n, "reward/timeouts": n} of this call.

        Raises TandemError only for a configuration mistake (with "auto", a data source that has
        no verifier), before any sample is scored.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed: score() was called after close()")
        if isinstance(self.fn, AutoReward):
            for data_source in {s.prompt.data_source for s in samples}:
                self.fn.verifier_for(data_source)
        if not self._pool.active:
            log.warning("The reward process pool had stopped; starting a new one.")
            self._pool = self._start()
        futures = [
            self._pool.schedule(
                _score_in_worker,
                args=(self.spec, self.code_limits, s.prompt, s.response_text),
                timeout=self.timeout_s,
            )
            for s in samples
        ]
        # Backstop against a wedged pool (never reached when pebble works): every wave of
        # `num_workers` tasks may take the full timeout plus a worker replacement.
        waves = math.ceil(len(samples) / self.num_workers)
        deadline = time.monotonic() + waves * (self.timeout_s + _WAVE_SLACK_S) + 30.0
        failures: list[tuple[str, str, Sample]] = []  # (metric, why, sample)
        for sample, future in zip(samples, futures, strict=True):
            sample.reward, sample.reward_parts, metric, why = _outcome(future, deadline, self.timeout_s)
            if metric:
                failures.append((metric, why, sample))
        _log_failures(failures)
        return {
            "reward/errors": float(sum(kind == "reward/errors" for kind, _, _ in failures)),
            "reward/timeouts": float(sum(kind == "reward/timeouts" for kind, _, _ in failures)),
        }

    def close(self) -> None:
        """Stop the workers. Idempotent."""
        self._closed = True
        self._pool.stop()
        self._pool.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(future: ProcessFuture, deadline: float, timeout_s: float) -> tuple[float, dict, str, str]:
    """(score, parts, "", "") on success, else (0.0, {}, metric name, why)."""
    try:
        score, parts, error = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        future.cancel()  # only does something when the backstop deadline fired
        return 0.0, {}, "reward/timeouts", f"timed out after {timeout_s:g} s"
    except ProcessExpired as e:
        return 0.0, {}, "reward/errors", f"the worker process died (exit code {e.exitcode})"
    except Exception as e:  # e.g. an argument or result that does not pickle
        return 0.0, {}, "reward/errors", f"{type(e).__name__}: {e}"
    if error is None and not math.isfinite(score):
        error = f"the reward function returned a non-finite score {score}"
    if error is not None:
        return 0.0, {}, "reward/errors", error
    return score, parts, "", ""


def _log_failures(failures: list[tuple[str, str, Sample]]) -> None:
    for _, why, sample in failures[:_MAX_LOGGED]:
        log.warning(
            "Reward 0.0 for a sample of data source %r: %s. Response begins: %r",
            sample.prompt.data_source,
            why,
            sample.response_text[:80],
        )
    if len(failures) > _MAX_LOGGED:
        log.warning(
            "... and %d more samples got reward 0.0 for the same kinds of reasons.",
            len(failures) - _MAX_LOGGED,
        )


def _ping() -> None:
    pass


@cache
def _worker_fn(spec: str, code_limits: CodeLimits) -> RewardFn:
    return load_reward_fn(spec, code_limits)


def _warm_worker(spec: str, code_limits: CodeLimits) -> None:
    """Resolve the reward function when the worker starts, not inside a timed call."""
    try:
        _worker_fn(spec, code_limits)
        if spec in ("auto", "math"):
            import math_verify  # noqa: F401  # imports sympy (~0.7 s), which would eat a call's timeout
    except Exception:
        pass  # the call itself will raise it again and report it for its sample


def _score_in_worker(
    spec: str, code_limits: CodeLimits, prompt: Prompt, response: str
) -> tuple[float, dict[str, float], str | None]:
    """Runs in a worker: (score, parts, None), or (0.0, {}, error text) when the function raised.

    Errors come back as text, not as exceptions, so a user's exception class need not unpickle
    in the parent and a timeout or a dead worker is the only thing the future itself raises.
    """
    try:
        score, parts = _worker_fn(spec, code_limits)(prompt, response)
        return float(score), {k: float(v) for k, v in parts.items()}, None
    except BaseException as e:  # noqa: B036  # even SystemExit costs only this sample
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return 0.0, {}, f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno} in {frame.name})"
