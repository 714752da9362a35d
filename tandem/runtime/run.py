"""`tandem train`: check the inputs, start the actors, run the loop, leave the run directory behind."""

import json
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

from tandem.config import Config, save_config
from tandem.controller.loop import Loop, Stopped
from tandem.controller.metrics import MetricsLogger, require_wandb
from tandem.controller.timeline import Span
from tandem.determinism import check_batch_invariance, machine
from tandem.paths import check_writable, run_lock
from tandem.reward.user_fn import load_within
from tandem.runtime.local import cpu_threads
from tandem.runtime.memory import peak_memory
from tandem.runtime.resume import find_resume
from tandem.runtime.roles import build_data
from tandem.runtime.startup import build_cluster, place, resolve_inputs

IMPORTED = time.time()  # process_start's fallback


def wandb_options(cfg: Config) -> dict | None:
    """`wandb.init`'s arguments from run.wandb_*, the resolved config as the run's config; None
    without run.wandb."""
    r = cfg.run
    if not r.wandb:
        return None
    return dict(
        project=r.wandb_project,
        entity=r.wandb_entity or None,
        name=r.wandb_name or r.name,
        mode=r.wandb_mode,
        config=asdict(cfg),
    )


def role_threads(cfg: Config) -> set[int]:
    """The torch thread counts the run's roles will have (placement's shares, or run.threads)."""
    import ray

    from tandem.runtime.cluster import plan_slots

    return {cfg.run.threads or s.threads for s in plan_slots(cfg, ray.cluster_resources())}


DRIVER = "driver/0"  # the driver's row in timeline.json: its start-up


def process_start() -> float:
    """When this process started (time.time() seconds): Linux's record of it, else when tandem's
    CLI was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED


def first_call(spans: list[Span]) -> float:
    """When the first rollout call (validation or generation) began: where start-up ends."""
    return min(s.start for s in spans if s.role == "rollout")


def run_training(cfg: Config, on_step=None) -> dict[str, float]:
    """Train for cfg.run.steps versions in cfg.run.mode; -> the summary (held-out accuracy before and
    after, throughput). `on_step(loop)` is called after each train step (tests use it).
    `run.resume` continues from a checkpoint; SIGINT / SIGTERM save one and raise `Stopped`.
    One run per run directory at a time: a second is refused at once (`run_lock`)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    check_writable(run_dir / "checkpoints", "run.out_dir")  # now, not at the first save
    signals = Signals()
    with run_lock(run_dir), signals.installed(), ExitStack() as stack:  # held until the run ends
        try:
            return _train(cfg, run_dir, on_step, signals, stack)
        except KeyboardInterrupt:  # what a signal raises inside Ray's waits: see Signals
            if signals.stopped is None:
                raise
            raise signals.stopped from None
        finally:
            signals.closing = True  # for Ray's shutdown too


def _train(cfg: Config, run_dir: Path, on_step, signals: "Signals", stack: ExitStack) -> dict[str, float]:
    startup = [Span("imports", DRIVER, process_start(), time.time())]  # ... to here: Python, imports
    # Every model path a directory, once; build_data checks the checkpoint, then its tokenizer.
    cfg = resolve_inputs(cfg, check_tokenizer=False)
    resume = find_resume(cfg, run_dir)  # a damaged or incompatible checkpoint is refused here
    if cfg.run.wandb:
        require_wandb()
    begun = time.time()
    data = build_data(cfg)  # bad input fails here, before any actor starts
    load_within(cfg.reward.pool_fn, cfg.reward.import_timeout_s)  # a module that hangs at import ends it here
    startup.append(Span("data", DRIVER, begun, time.time()))
    begun = time.time()
    cfg, local = place(cfg, stack)  # Ray, when the run needs it, started (and stopped) here
    if not local:
        startup.append(Span("ray", DRIVER, begun, time.time()))
    signals.install()  # again: ray.init puts its own SIGTERM handler in (it aborts the process)
    if cfg.run.deterministic:  # refused here, in seconds, if this machine's kernels cannot keep it
        threads = {cfg.run.threads or cpu_threads()} if local else role_threads(cfg)
        seconds = check_batch_invariance(cfg, threads)
        print(
            f"run.deterministic: batch-invariance self-test passed in {seconds:.1f} s "
            f"({machine(cfg.run.device)}; {cfg.train.dtype}; threads {sorted(threads)})"
        )
    save_config(cfg, run_dir / "config.yaml")  # as resolved: device and dtypes concrete
    cluster = build_cluster(cfg, local)
    loop = Loop(cfg, data, cluster)
    log = None
    try:
        loop.checkpoints.clear_partial()
        if resume is not None:
            loop.resume(resume)
        resume_step = loop.version if resume is not None else None
        log = MetricsLogger(
            run_dir, cfg.run.steps, cfg.run.tensorboard, cfg.run.progress, resume_step, wandb_options(cfg)
        )
        if on_step is not None:
            loop.on_step = lambda version: on_step(loop)
        signals.loop = loop
        summary = loop.run(log) | peak_memory(cluster, cfg.run.timeout_s)
        summary["timing_s/startup"] = first_call(loop.timeline.spans) - startup[0].start
        loop.save("final")
        log.log(cfg.run.steps, summary)
    finally:
        signals.closing = True  # a signal now would cut the clean-up short: it is ignored
        loop.timeline.add(*startup, *cluster.startup())
        loop.timeline.start = startup[0].start
        loop.timeline.write(run_dir / "timeline.json")
        if log is not None:
            log.close()
        cluster.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class Signals:
    """SIGINT / SIGTERM during `tandem train`.

    Once the loop runs, the first asks it to stop (`Loop.stop_signal`): it saves a checkpoint when
    the running train step ends, or at once while none runs, and raises `Stopped`; the loop looks
    at least every `STOP_POLL_S`. A second signal, or any signal before the loop runs, stops at once:
    the handler keeps a `Stopped` naming the newest complete checkpoint and raises KeyboardInterrupt,
    the one exception that Ray's waits let through (they swallow others, and turn a subclass of it
    into KeyboardInterrupt itself); `run_training` raises the kept `Stopped` in its place. Either
    way the run's `finally` blocks stop its actors and the Ray it started; signals during that
    clean-up are ignored, so it leaves no process behind.
    """

    def __init__(self):
        self.loop: Loop | None = None
        self.stopped: Stopped | None = None
        self.closing = False  # the run's clean-up has begun

    def handler(self, signum, frame) -> None:
        name, loop = signal.Signals(signum).name, self.loop
        if self.closing:
            print(f"\n{name}: already stopping; the actors and Ray are being shut down.", file=sys.stderr)
            return
        if loop is not None and not loop.stop_signal:
            loop.stop_signal = name
            if loop.training:
                what = f"saving a checkpoint when step {loop.version + 1} ends, then stopping"
            elif loop.version > loop.first_version:
                what = f"saving a checkpoint of step {loop.version}, then stopping"
            else:
                what = "stopping (no step trained since the start, nothing to save)"
            print(f"\n{name}: {what} (send it again to stop at once).", file=sys.stderr)
            return
        latest = loop.checkpoints.latest() if loop is not None else None
        self.stopped = Stopped(name, loop.version if loop is not None else 0, latest)
        raise KeyboardInterrupt

    def install(self) -> dict:
        """This handler for SIGINT and SIGTERM -> the handlers it replaced ({} off the main thread,
        where signals stay as they were)."""
        try:
            return {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:
            return {}

    @contextmanager
    def installed(self):
        previous = self.install()
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
