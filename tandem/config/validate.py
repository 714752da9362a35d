"""Value checks that types alone cannot express. Every error names the field and what is valid."""

from tandem.config.schema import Config
from tandem.errors import TandemError

MODES = ("sync",)
ENGINES = ("builtin",)
SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16")


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise TandemError(f"Config '{key}' {message}")


def _one_of(value: str, valid: list[str] | tuple[str, ...], key: str, what: str) -> None:
    _check(value in valid, key, f"is {value!r}, not a known {what}. Valid names: {', '.join(valid)}.")


def validate(cfg: Config) -> None:
    from tandem.algo import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
    from tandem.data.tasks import TASKS

    _one_of(cfg.run.mode, MODES, "run.mode", "mode")
    _check(cfg.run.steps >= 1, "run.steps", f"must be >= 1, got {cfg.run.steps}.")
    _check(cfg.run.val_every >= 0, "run.val_every", "must be >= 0 (0 = validate only at start and end).")
    _one_of(cfg.model.dtype, DTYPES, "model.dtype", "dtype")
    _one_of(cfg.rollout.engine, ENGINES, "rollout.engine", "engine")
    _check(cfg.rollout.batch_size >= 1, "rollout.batch_size", "must be >= 1.")
    _check(cfg.rollout.n >= 1, "rollout.n", "must be >= 1.")
    _check(cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy).")
    _check(0 < cfg.rollout.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {cfg.rollout.top_p}.")
    _check(cfg.rollout.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off).")
    _check(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1.")
    _check(cfg.rollout.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1.")
    _check(cfg.run.save_every >= 0, "run.save_every", "must be >= 0 (0 = only the final checkpoint).")
    _check(cfg.train.warmup_steps >= 0, "train.warmup_steps", "must be >= 0.")
    _check(cfg.data.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1.")
    if not cfg.data.train_files:
        _one_of(cfg.data.task, TASKS.names(), "data.task", "task")
    _check(cfg.reward.num_workers >= 1, "reward.num_workers", "must be >= 1.")
    _check(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds.")
    _one_of(cfg.algo.adv_estimator, ADV_ESTIMATORS.names(), "algo.adv_estimator", "advantage estimator")
    _one_of(cfg.algo.policy_loss, POLICY_LOSSES.names(), "algo.policy_loss", "policy loss")
    _one_of(cfg.algo.kl_estimator, KL_ESTIMATORS.names(), "algo.kl_estimator", "KL estimator")
    _one_of(cfg.algo.loss_agg, LOSS_AGGS.names(), "algo.loss_agg", "loss aggregation")
    _check(0 <= cfg.algo.clip_low < 1, "algo.clip_low", f"must be in [0, 1), got {cfg.algo.clip_low}.")
    _check(cfg.algo.clip_high >= 0, "algo.clip_high", f"must be >= 0, got {cfg.algo.clip_high}.")
    _check(cfg.algo.clip_c is None or cfg.algo.clip_c > 1, "algo.clip_c", "must be > 1 (or null to disable).")
    _check(cfg.train.lr > 0, "train.lr", "must be > 0.")
    _one_of(cfg.train.schedule, SCHEDULES, "train.schedule", "LR schedule")
    _check(len(cfg.train.betas) == 2, "train.betas", "must be two numbers, e.g. [0.9, 0.999].")
    _check(cfg.train.epochs >= 1, "train.epochs", "must be >= 1.")
    _check(cfg.train.mini_batch_size >= 0, "train.mini_batch_size", "must be >= 0 (0 = whole batch).")
    _check(cfg.train.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1.")
    _check(0 <= cfg.sft.flawed_fraction <= 1, "sft.flawed_fraction", "must be in [0, 1].")
    _check(
        1 <= cfg.sft.batch_size <= cfg.data.train_size,
        "sft.batch_size",
        f"must be between 1 and data.train_size={cfg.data.train_size}.",
    )
    _check(
        cfg.sft.hidden_size % cfg.sft.num_attention_heads == 0,
        "sft.hidden_size",
        "must be divisible by sft.num_attention_heads.",
    )
    _check(
        cfg.sft.num_attention_heads % cfg.sft.num_key_value_heads == 0,
        "sft.num_key_value_heads",
        "must divide sft.num_attention_heads.",
    )
