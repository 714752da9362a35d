"""Sync mode: generate, reward, train, push weights — strictly on-policy, one step at a time."""

import json
from pathlib import Path

from tandem.config import Config, save_config
from tandem.controller.evaluation import evaluate
from tandem.controller.metrics import MetricsLogger, timed
from tandem.controller.roles import Roles, build_roles, save_checkpoint
from tandem.controller.stats import rollout_stats
from tandem.rollout import make_groups


def run_sync(cfg: Config) -> dict[str, float]:
    """Train for cfg.run.steps steps; returns the summary (held-out accuracy before and after)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    roles = build_roles(cfg)
    log = MetricsLogger(run_dir, cfg.run.steps, cfg.run.tensorboard, cfg.run.progress)
    try:
        start = validate(roles)
        log.log(0, start)
        for step in range(1, cfg.run.steps + 1):
            metrics = train_one_step(roles, cfg)
            if step == cfg.run.steps or (cfg.run.val_every and step % cfg.run.val_every == 0):
                metrics.update(validate(roles))
            if step == cfg.run.steps:
                summary = summarize(start, metrics)
                metrics.update(summary)
            if cfg.run.save_every and step % cfg.run.save_every == 0:
                save_checkpoint(roles, run_dir / "checkpoints" / f"step_{step}")
            log.log(step, metrics)
        save_checkpoint(roles, run_dir / "checkpoints" / "final")
    finally:
        log.close()
        roles.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summarize(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    summary = {"critic/score/mean_final": end["critic/score/mean"]}
    if "val/accuracy" in start:
        summary.update(
            {
                "val/accuracy_start": start["val/accuracy"],
                "val/accuracy_final": end["val/accuracy"],
                "val/accuracy_gain_points": 100 * (end["val/accuracy"] - start["val/accuracy"]),
            }
        )
    return summary


def train_one_step(roles: Roles, cfg: Config) -> dict[str, float]:
    timings: dict[str, float] = {}
    trained_version = roles.trainer.version
    with timed(timings, "step"):
        prompts, ids = roles.train_data.next_batch()
        with timed(timings, "gen"):
            samples = roles.rollout.generate(make_groups(prompts, ids, cfg.rollout.n), roles.params)
        with timed(timings, "reward"):
            reward_metrics = roles.reward.score(samples)
        with timed(timings, "train"):
            train_metrics = roles.trainer.train_step(samples)
        with timed(timings, "sync"):
            roles.rollout.load_weights(roles.trainer.named_weights(), roles.trainer.version)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    perf = {
        "perf/throughput_tokens_per_s": tokens / timings["timing_s/step"],
        "perf/samples_per_s": len(samples) / timings["timing_s/step"],
    }
    return {
        **rollout_stats(samples, trained_version),
        **reward_metrics,
        **train_metrics,
        **timings,
        **perf,
        "version": float(roles.trainer.version),
    }


def validate(roles: Roles) -> dict[str, float]:
    """Held-out metrics of the current policy; empty when the run has no validation prompts."""
    if not roles.val_prompts:
        return {}
    timings: dict[str, float] = {}
    with timed(timings, "val"):
        metrics, _ = evaluate(roles.rollout, roles.reward, roles.val_prompts, roles.val_ids, roles.val_params)
    return {**metrics, **timings}
