"""`tandem train`: check the inputs, start the actors, run the loop, leave the run directory behind."""

import json
from pathlib import Path

from tandem.config import Config, save_config
from tandem.controller.cluster import Cluster
from tandem.controller.loop import Loop
from tandem.controller.metrics import MetricsLogger
from tandem.controller.roles import build_data


def run_training(cfg: Config, on_step=None) -> dict[str, float]:
    """Train for cfg.run.steps versions in cfg.run.mode; -> the summary (held-out accuracy before and
    after, throughput). `on_step(loop)` is called after each train step (tests use it)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    data = build_data(cfg)  # bad input fails here, before any actor starts
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
    return summary
