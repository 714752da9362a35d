"""`tandem train`: check the inputs, start the actors, run the loop, leave the run directory behind."""

import json
from dataclasses import replace
from pathlib import Path

import ray

from tandem import devices
from tandem.config import Config, save_config
from tandem.controller.cluster import Cluster, start_ray
from tandem.controller.loop import Loop
from tandem.controller.metrics import MetricsLogger
from tandem.controller.roles import build_data
from tandem.errors import TandemError
from tandem.reward.user_fn import canonical_spec, load_reward_fn


def with_absolute_paths(cfg: Config) -> Config:
    """Actors may run in another directory (or on another node): give them absolute paths."""

    def absolute(path: str) -> str:
        return str(Path(path).resolve()) if path and not path.startswith("builtin:") else path

    return replace(
        cfg,
        model=replace(cfg.model, path=absolute(cfg.model.path), tokenizer=absolute(cfg.model.tokenizer)),
        reward=replace(cfg.reward, fn=canonical_spec(cfg.reward.fn)),
        run=replace(cfg.run, out_dir=absolute(cfg.run.out_dir)),
    )


def run_training(cfg: Config, on_step=None) -> dict[str, float]:
    """Train for cfg.run.steps versions in cfg.run.mode; -> the summary (held-out accuracy before and
    after, throughput). `on_step(loop)` is called after each train step (tests use it)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = with_absolute_paths(cfg)
    data = build_data(cfg)  # bad input fails here, before any actor starts
    load_reward_fn(cfg.reward.fn)
    start_ray(cfg)
    cfg = devices.resolve(cfg, ray.cluster_resources().get("GPU", 0))
    save_config(cfg, run_dir / "config.yaml")  # as resolved: device and dtypes concrete
    cluster = Cluster.start(cfg)
    log = MetricsLogger(run_dir, cfg.run.steps, cfg.run.tensorboard, cfg.run.progress)
    loop = Loop(cfg, data, cluster)
    if on_step is not None:
        loop.on_step = lambda version: on_step(loop)
    try:
        summary = loop.run(log.log)
        loop.save("final")
        log.log(cfg.run.steps, summary)
    finally:
        loop.timeline.write(run_dir / "timeline.json")
        log.close()
        cluster.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary["reward/failed_fraction"] == 1.0:  # it trained on nothing: say so, and exit non-zero
        raise TandemError(
            f"Every reward of the run failed (all {cfg.run.steps * cfg.rollout.batch_size * cfg.rollout.n}"
            f" training samples errored or timed out in reward.fn={cfg.reward.fn!r}), so it learned "
            f"nothing. The run directory {run_dir} is kept; metrics.jsonl counts reward/errors and "
            "reward/timeouts per step. Try the function on one sample by hand."
        )
    return summary
