"""verl's config keys with tandem's nearest equivalent, so a key written for verl is answered with ours.

The loader checks every key of the recipe and the overrides against this table before anything
else; docs/config.md ("Coming from verl") shows the same table, and a test keeps the two equal.
"""

# verl key -> (tandem key, note). An empty tandem key means there is no equivalent; the note says why.
VERL_KEYS: dict[str, tuple[str, str]] = {
    "data.train_batch_size": ("rollout.batch_size", "prompts per step"),
    "data.val_batch_size": ("", "validation generates for the whole held-out set at once"),
    "data.max_response_length": ("rollout.max_new_tokens", ""),
    "data.truncation": ("", "a prompt over data.max_prompt_length is an error naming its row"),
    "data.seed": ("run.seed", "one seed for the whole run"),
    "actor_rollout_ref.model.path": ("model.path", ""),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("train.gradient_checkpointing", ""),
    "actor_rollout_ref.model.use_remove_padding": ("train.padding_free", ""),
    "actor_rollout_ref.model.lora_rank": ("train.lora.rank", "0 is off"),
    "actor_rollout_ref.model.lora_alpha": ("train.lora.alpha", ""),
    "actor_rollout_ref.model.target_modules": ("train.lora.target_modules", "a list of names or all-linear"),
    "actor_rollout_ref.actor.optim.lr": ("train.lr", ""),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("train.warmup_steps", ""),
    "actor_rollout_ref.actor.optim.warmup_style": ("train.schedule", "constant, linear or cosine"),
    "actor_rollout_ref.actor.optim.weight_decay": ("train.weight_decay", ""),
    "actor_rollout_ref.actor.optim.betas": ("train.betas", ""),
    "actor_rollout_ref.actor.grad_clip": ("train.grad_clip", ""),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        "train.mini_batch_size",
        "counted in samples, not prompts: verl's value times rollout.n",
    ),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
        "train.micro_batch_tokens",
        "a budget of tokens per forward and backward, not a count of samples",
    ),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("train.micro_batch_tokens", ""),
    "actor_rollout_ref.actor.ppo_epochs": ("train.epochs", ""),
    "actor_rollout_ref.actor.clip_ratio": ("algo.clip_low", "and algo.clip_high, the same value in both"),
    "actor_rollout_ref.actor.clip_ratio_low": ("algo.clip_low", ""),
    "actor_rollout_ref.actor.clip_ratio_high": ("algo.clip_high", ""),
    "actor_rollout_ref.actor.clip_ratio_c": ("algo.clip_c", ""),
    "actor_rollout_ref.actor.loss_agg_mode": ("algo.loss_agg", "the same mode names"),
    "actor_rollout_ref.actor.use_kl_loss": ("algo.kl_coef", "the KL loss is on when algo.kl_coef > 0"),
    "actor_rollout_ref.actor.kl_loss_coef": ("algo.kl_coef", ""),
    "actor_rollout_ref.actor.kl_loss_type": ("algo.kl_estimator", "k1, k2, k3 or verl's kl, mse, low_var_kl"),
    "actor_rollout_ref.actor.entropy_coeff": ("algo.entropy_coef", ""),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("algo.policy_loss", "ppo_clip, gspo or cispo"),
    "actor_rollout_ref.actor.strategy": ("train.strategy", "ddp or fsdp2"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": (
        "train.offload",
        "optimizer (parameters, gradients and AdamW step on the CPU), with train.strategy=fsdp2",
    ),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("train.offload", "optimizer, with fsdp2"),
    "actor_rollout_ref.rollout.name": ("rollout.engine", "builtin, paged or vllm"),
    "actor_rollout_ref.rollout.n": ("rollout.n", ""),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", ""),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", ""),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", "0 is off (verl's -1)"),
    "actor_rollout_ref.rollout.response_length": ("rollout.max_new_tokens", ""),
    "actor_rollout_ref.rollout.dtype": ("rollout.dtype", ""),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("rollout.vllm_gpu_memory_utilization", ""),
    "actor_rollout_ref.rollout.enforce_eager": ("rollout.vllm_enforce_eager", ""),
    "actor_rollout_ref.rollout.free_cache_engine": ("rollout.free_memory_during_train", ""),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (
        "",
        "each rollout worker holds the whole model; add workers with rollout.num_workers",
    ),
    "actor_rollout_ref.rollout.val_kwargs.temperature": ("rollout.val_temperature", ""),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": ("rollout.val_temperature", "0 is greedy"),
    "algorithm.adv_estimator": ("algo.adv_estimator", ""),
    "algorithm.norm_adv_by_std_in_grpo": ("algo.norm_by_std", ""),
    "algorithm.gamma": ("algo.gamma", ""),
    "algorithm.lam": ("algo.lam", ""),
    "critic.model.path": ("critic.path", ""),
    "critic.optim.lr": ("critic.lr", ""),
    "critic.cliprange_value": ("critic.vf_clip", ""),
    "algorithm.use_kl_in_reward": ("", "tandem's KL is a loss term only, algo.kl_coef"),
    "algorithm.kl_ctrl.kl_coef": ("", "tandem's KL is a loss term only, algo.kl_coef"),
    "algorithm.rollout_correction.rollout_is": ("algo.corrections", "[tis] (token) or [seq_tis] (sequence)"),
    "algorithm.rollout_correction.rollout_is_threshold": ("algo.correction_cap", ""),
    "algorithm.rollout_correction.bypass_mode": ("algo.corrections", "[bypass]"),
    "trainer.total_training_steps": ("run.steps", ""),
    "trainer.total_epochs": ("run.steps", "steps, not epochs: one step is rollout.batch_size prompts"),
    "trainer.save_freq": ("run.save_every", ""),
    "trainer.test_freq": ("run.val_every", ""),
    "trainer.val_before_train": (
        "",
        "tandem always validates before the first step when it has held-out data",
    ),
    "trainer.n_gpus_per_node": ("placement.num_gpus", "GPUs for the whole run; 0 = all the Ray cluster has"),
    "trainer.nnodes": (
        "",
        "tandem places its roles on whatever the Ray cluster has; join one with ray.address",
    ),
    "trainer.resume_mode": ("run.resume", 'auto, a checkpoint path, or "" for off'),
    "trainer.resume_from_path": ("run.resume", "a checkpoint path"),
    "trainer.max_actor_ckpt_to_keep": ("run.keep_checkpoints", ""),
    "trainer.default_local_dir": ("run.out_dir", "a run writes to run.out_dir/run.name"),
    "trainer.project_name": ("", "a run is named by run.name alone, under run.out_dir"),
    "trainer.experiment_name": ("run.name", ""),
    "trainer.logger": ("run.tensorboard", "metrics.jsonl is always written"),
    "trainer.device": ("run.device", ""),
    "custom_reward_function.path": ("reward.fn", "one spec, path/to/file.py:function"),
    "custom_reward_function.name": ("reward.fn", "one spec, path/to/file.py:function"),
    "reward_model.reward_manager": (
        "",
        "reward.fn scores each response; reward.num_workers score in parallel",
    ),
}

# verl's top-level sections that are not tandem's, and where their keys went.
VERL_SECTIONS: dict[str, str] = {
    "actor_rollout_ref": "tandem splits it into model, rollout, train and algo",
    "algorithm": "tandem's section is algo",
    "trainer": "tandem's run (steps, saving, validation, naming) and placement sections hold those",
    "reward_model": "tandem's reward section names the function (reward.fn)",
    "custom_reward_function": "tandem's is reward.fn (path/to/file.py:function)",
}


def verl_key_error(key: str) -> str | None:
    """The error for `key` (dotted) if it is written as for verl: the equivalent, or why none; else None."""
    plain = key.lstrip("+")  # verl's Hydra overrides add keys with a leading +
    where = " See docs/config.md, 'Coming from verl'."
    if plain in VERL_KEYS:
        target, note = VERL_KEYS[plain]
        if not target:
            return f"Config '{key}' is verl's; tandem has no equivalent: {note}.{where}"
        extra = f" ({note})" if note else ""
        return f"Config '{key}' is verl's name; tandem's equivalent is '{target}'{extra}.{where}"
    section = plain.split(".", 1)[0]
    if section in VERL_SECTIONS:
        return (
            f"Config '{key}' is a verl key tandem has no mapping for; verl's '{section}' section: "
            f"{VERL_SECTIONS[section]}.{where}"
        )
    return None
