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

A function that times out or kills its worker on most samples of a batch ends the `score` call with
a TandemError instead, as no run can learn through it (checked as results come in, so the error
comes after two waves of timeouts, not after every sample has waited out its own). A score or part
that is not a finite number within +-`max_abs` costs its sample like an exception.
Whatever a call prints (fds 1 and 2, so C code and subprocesses too) is captured: its first
`OUTPUT_HEAD` bytes go to `output_log`, the total to `reward/output_bytes`.
"""

import logging
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import TimeoutError
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pebble import ProcessExpired, ProcessFuture, ProcessPool

from tandem.errors import TandemError
from tandem.reward.code import CodeLimits
from tandem.reward.user_fn import AutoReward, RewardFn, canonical_spec, load_reward_fn, load_within
from tandem.sample import Prompt, Sample
from tandem.sandbox import die_with_parent

log = logging.getLogger("tandem.reward")

_MAX_LOGGED = 8  # failures logged one by one per `score` call; the rest in one summary line
# Headroom per wave of tasks for the backstop deadline: a worker that ignores SIGTERM gets 3 s
# before pebble SIGKILLs it, and its replacement has to start.
_WAVE_SLACK_S = 5.0
# A sample's time the code verifier leaves unspent: the worker's own overhead and the last test's
# sandbox teardown.
_CODE_SLACK_S = 1.0
OUTPUT_HEAD = 2000  # bytes of each call's printed output kept in the output log
# Timeouts and dead workers cost wall time (a timeout each, or a replacement): a batch whose first
# STALL_WAVES waves of results are all of them, or more than half of whose samples are, ends the run.
STALL_WAVES = 2


class RewardPool:
    """A process pool that sets `sample.reward` and `sample.reward_parts` in place.

    `fn` is a reward spec (see `load_reward_fn`): resolved here, so a bad name fails at startup,
    and again by name in each worker. Workers live across `score` calls; a killed one is replaced.
    `sandbox_timeout_s` and `sandbox_memory_mb` limit each test the code verifier runs. A score
    beyond +-`max_abs` is an error; `output_log` receives the head of what each call printed.
    """

    def __init__(
        self,
        fn: str = "auto",
        num_workers: int = 2,
        timeout_s: float = 10.0,
        sandbox_timeout_s: float = 5.0,
        sandbox_memory_mb: int = 512,
        max_abs: float = 1e6,
        import_timeout_s: float = 60.0,
        output_log: Path | None = None,
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
        self.fn: RewardFn = load_within(self.spec, import_timeout_s, self.code_limits)
        self.num_workers, self.timeout_s, self.max_abs = num_workers, timeout_s, max_abs
        self.output_log, self.printed = output_log, 0  # bytes the function printed, over the pool's life
        self._pool = self._start()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Any, output_log: Path | None = None) -> "RewardPool":
        """The pool of a config's reward section (`tandem.config.schema.RewardConfig`: not imported,
        since the config's validation reads the judge's parsers in this package)."""
        return cls(
            cfg.pool_fn,
            cfg.num_workers,
            cfg.timeout_s,
            cfg.sandbox_timeout_s,
            cfg.sandbox_memory_mb,
            cfg.max_abs,
            cfg.import_timeout_s,
            output_log,
        )

    def _start(self) -> ProcessPool:
        # "forkserver": the parent has torch imported and runs threads, and forking such a process
        # can deadlock a child on a lock some other thread held. The fork server is a clean,
        # single-threaded process started once, so replacing a worker killed on timeout costs a
        # fork rather than spawn's fresh interpreter and re-imports. Measured: both start 2
        # workers in ~0.1 s here. Where forkserver is unavailable (Windows), spawn.
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload(["tandem.reward.orphans"])
        pool = ProcessPool(
            max_workers=self.num_workers,
            initializer=_warm_worker,
            initargs=(self.spec, self.code_limits),
            context=context,
        )
        # pebble starts its workers on the first task; start them now, so that the fork server's
        # start (which re-imports the main module, e.g. torch: ~1.5 s) overlaps the caller's setup.
        pool.schedule(_ping)
        return pool

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Score every sample in place; -> this call's counts: reward/errors, reward/timeouts (a sample
        each) and reward/output_bytes (what the function printed).

        Raises TandemError for a configuration mistake (with "auto", a data source that has no
        verifier) before any sample is scored, and for a function that stalls most of the batch.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed: score() was called after close()")
        given = [s for s in samples if s.agent_reward is not None]  # the agent's own reward
        for s in given:
            s.reward, s.reward_parts = s.agent_reward, {"agent": s.agent_reward}
        samples = [s for s in samples if s.agent_reward is None]
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
        stalled, printed = [], []  # (why) of timeouts and dead workers; (sample, head, bytes)
        for done, (sample, future) in enumerate(zip(samples, futures, strict=True), 1):
            outcome = _outcome(future, deadline, self.timeout_s, self.max_abs)
            sample.reward, sample.reward_parts, metric, why = (
                outcome.score,
                outcome.parts,
                outcome.metric,
                outcome.why,
            )
            if outcome.printed:
                printed.append((sample, outcome.head, outcome.printed))
            if metric:
                failures.append((metric, why, sample))
            if outcome.stalled:
                stalled.append(why)
            if len(stalled) > len(samples) / 2 or (
                len(stalled) == done >= min(STALL_WAVES * self.num_workers, len(samples))
            ):
                for f in futures[done:]:
                    f.cancel()
                raise self._stalled(stalled, done, len(samples))
        _log_failures(failures)
        return {
            "reward/errors": float(sum(kind == "reward/errors" for kind, _, _ in failures)),
            "reward/timeouts": float(sum(kind == "reward/timeouts" for kind, _, _ in failures)),
            "reward/output_bytes": float(self._keep_output(printed, len(samples))),
        }

    def _stalled(self, stalled: list[str], done: int, total: int) -> TandemError:
        timeouts = sum(why.startswith("timed out") for why in stalled)
        waves = math.ceil(total / self.num_workers)
        return TandemError(
            f"Reward function {self.spec!r} stalled on {len(stalled)} of the first {done} samples of a "
            f"batch of {total}: {timeouts} timed out (reward.timeout_s={self.timeout_s:g}) and "
            f"{len(stalled) - timeouts} killed their worker process (last: {stalled[-1]}). The run "
            f"stops rather than wait up to ~{waves * self.timeout_s:.0f} s for the rest of the batch. "
            "Call the function on one sample by hand; if it is slow but right, raise reward.timeout_s "
            "or reward.num_workers."
        )

    def _keep_output(self, printed: list[tuple[Sample, str, int]], calls: int) -> int:
        """The heads of what calls printed -> output_log; the first time, a line saying where."""
        total = sum(n for _, _, n in printed)
        if not total:
            return 0
        if self.output_log is not None:
            with open(self.output_log, "a") as f:
                for sample, head, n in printed:
                    more = f" (first {len(head.encode())} shown)" if n > len(head.encode()) else ""
                    f.write(f"--- data source {sample.prompt.data_source!r}: {n} bytes{more}\n{head}\n")
        if not self.printed:
            where = self.output_log or "nowhere (no run directory)"
            log.warning(
                "Reward function %r printed %d bytes in %d of %d calls. Each call's output is captured: "
                "its first %d bytes go to %s, and reward/output_bytes counts it per step.",
                self.spec, total, len(printed), calls, OUTPUT_HEAD, where,
            )  # fmt: skip
        self.printed += total
        return total

    def close(self) -> None:
        """Stop the workers. Idempotent."""
        self._closed = True
        self._pool.stop()
        self._pool.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Outcome:
    score: float = 0.0
    parts: dict = field(default_factory=dict)
    metric: str = ""  # "" on success, else the counter it adds to
    why: str = ""
    stalled: bool = False  # a timeout or a dead worker: it cost wall time, not just this sample
    head: str = ""  # the first OUTPUT_HEAD bytes the call printed
    printed: int = 0  # how many bytes it printed


def _outcome(future: ProcessFuture, deadline: float, timeout_s: float, max_abs: float) -> _Outcome:
    try:
        score, parts, error, head, printed = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        future.cancel()  # only does something when the backstop deadline fired
        return _Outcome(metric="reward/timeouts", why=f"timed out after {timeout_s:g} s", stalled=True)
    except ProcessExpired as e:
        why = f"the worker process died (exit code {e.exitcode})"
        return _Outcome(metric="reward/errors", why=why, stalled=True)
    except Exception as e:  # e.g. an argument or result that does not pickle
        return _Outcome(metric="reward/errors", why=f"{type(e).__name__}: {e}")
    if error is None:
        error = _out_of_bounds(score, parts, max_abs)
    if error is not None:
        return _Outcome(metric="reward/errors", why=error, head=head, printed=printed)
    return _Outcome(score, parts, head=head, printed=printed)


def _out_of_bounds(score: float, parts: dict[str, float], max_abs: float) -> str | None:
    """Why a score or part cannot be trained on (NaN, infinite, beyond +-max_abs), or None."""
    for name, value in [("score", score), *((f"part {k!r}", v) for k, v in parts.items())]:
        if not math.isfinite(value) or abs(value) > max_abs:
            kind = "a non-finite" if not math.isfinite(value) else f"beyond +-{max_abs:g} (reward.max_abs): a"
            return f"the reward function returned {kind} {name}, {value:g}"
    return None


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
    die_with_parent()  # with the fork server, or the pool's process under spawn
    try:
        _captured(lambda: _worker_fn(spec, code_limits))  # what its import prints is not a call's
        if spec in ("auto", "math"):
            import math_verify  # noqa: F401  # imports sympy (~0.7 s), which would eat a call's timeout
    except Exception:
        pass  # the call itself will raise it again and report it for its sample


@cache
def _capture_file():
    """This worker's file for a call's fds 1 and 2, and the fds they had."""
    return tempfile.TemporaryFile(), os.dup(1), os.dup(2)


def _captured(call):
    """call() with fds 1 and 2 (print, C code, subprocesses) in a file -> (its result, the first
    OUTPUT_HEAD bytes of what it printed, how many bytes it printed)."""
    file, out, err = _capture_file()
    sys.stdout.flush(), sys.stderr.flush()
    file.seek(0)
    file.truncate()
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    try:
        result = call()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(err, 2)
    printed = file.seek(0, os.SEEK_END)
    file.seek(0)
    head = file.read(OUTPUT_HEAD).decode("utf-8", "replace")
    return result, head, printed


def _score_in_worker(
    spec: str, code_limits: CodeLimits, prompt: Prompt, response: str
) -> tuple[float, dict[str, float], str | None, str, int]:
    """Runs in a worker: (score, parts, None, printed head, printed bytes), or (0.0, {}, error text,
    ...) when the function raised.

    Errors come back as text, not as exceptions, so a user's exception class need not unpickle
    in the parent and a timeout or a dead worker is the only thing the future itself raises.
    """

    def call() -> tuple[float, dict[str, float], str | None]:
        try:
            score, parts = _worker_fn(spec, code_limits)(prompt, response)
            return float(score), {k: float(v) for k, v in parts.items()}, None
        except BaseException as e:  # noqa: B036  # even SystemExit costs only this sample
            frame = traceback.extract_tb(e.__traceback__)[-1]
            return 0.0, {}, f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno} in {frame.name})"

    (score, parts, error), head, printed = _captured(call)
    return score, parts, error, head, printed
