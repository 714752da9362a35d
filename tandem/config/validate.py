"""Value checks that types alone cannot express. Every error names the field and what is valid."""

import inspect
import os

from tandem.config.schema import Config
from tandem.errors import TandemError

MODES = ("sync", "one_step_off", "async")
ON_UPDATE = ("drain", "abort", "continue")
TRANSPORTS = ("object_store", "broadcast")
TASKS = ("generate", "actor_train", "logp", "ref_logp", "critic")
ENGINES = ("builtin", "paged", "vllm")
SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("auto", "cpu", "cuda")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")
# float16 training would need loss scaling, which tandem does not do; bf16 has fp32's range.
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
STRATEGIES = ("ddp", "fsdp2")
OFFLOADS = ("none", "optimizer")
PROX_LOGPROBS = ("recompute", "interpolate")


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise TandemError(f"Config '{key}' {message}")


def _one_of(value: str, valid: list[str] | tuple[str, ...], key: str, what: str) -> None:
    _check(value in valid, key, f"is {value!r}, not a known {what}. Valid names: {', '.join(valid)}.")


def validate(cfg: Config) -> None:
    from tandem.algo import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
    from tandem.data.tasks import TASKS

    _one_of(cfg.run.mode, MODES, "run.mode", "mode")
    _check_run_name(cfg.run.name)
    _check(cfg.run.threads >= 0, "run.threads", "must be >= 0 (0 = the CPUs each role's placement gives it).")
    _check(cfg.ray.num_cpus >= 0, "ray.num_cpus", "must be >= 0 (0 = every core).")
    _check(cfg.run.max_staleness >= 0, "run.max_staleness", "must be >= 0 (0 = on-policy).")
    _check(cfg.run.generate_ahead_steps >= 1, "run.generate_ahead_steps", "must be >= 1.")
    _check(cfg.run.timeout_s > 0, "run.timeout_s", "must be > 0 seconds.")
    _check(cfg.rollout.num_workers >= 1, "rollout.num_workers", "must be >= 1.")
    _check(cfg.rollout.chunk_groups >= 1, "rollout.chunk_groups", "must be >= 1.")
    _check(cfg.rollout.length_tail_alpha >= 0, "rollout.length_tail_alpha", "must be >= 0 (0 = off).")
    _one_of(cfg.rollout.on_update, ON_UPDATE, "rollout.on_update", "weight-update policy")
    _check(cfg.train.num_workers >= 1, "train.num_workers", "must be >= 1.")
    _one_of(cfg.sync.transport, TRANSPORTS, "sync.transport", "weight transport")
    _check(cfg.sync.produce_bucket_mb > 0, "sync.produce_bucket_mb", "must be > 0.")
    _check(cfg.sync.consume_bucket_mb > 0, "sync.consume_bucket_mb", "must be > 0.")
    _check(cfg.sync.timeout_s > 0, "sync.timeout_s", "must be > 0 seconds.")
    _check(cfg.sync.every >= 1, "sync.every", "must be >= 1 (train steps between weight pushes).")
    _check(
        cfg.sync.every == 1 or (cfg.run.mode == "async" and cfg.run.max_staleness >= cfg.sync.every - 1),
        "sync.every",
        f"is {cfg.sync.every}: pushing every N steps needs run.mode=async with run.max_staleness >= N - 1 "
        f"(got mode {cfg.run.mode!r}, max_staleness {cfg.run.max_staleness}), or the buffer could not "
        "admit the groups the steps between two pushes train on.",
    )
    _check(cfg.rollout.calls_per_worker >= 1, "rollout.calls_per_worker", "must be >= 1.")
    _check_placement(cfg)
    _check_sim(cfg)
    _check(cfg.run.steps >= 1, "run.steps", f"must be >= 1, got {cfg.run.steps}.")
    _check(cfg.run.val_every >= 0, "run.val_every", "must be >= 0 (0 = validate only at start and end).")
    _one_of(cfg.run.device, DEVICES, "run.device", "device")
    _one_of(cfg.rollout.dtype, ROLLOUT_DTYPES, "rollout.dtype", "dtype")
    _check_train_precision(cfg)
    _one_of(cfg.rollout.engine, ENGINES, "rollout.engine", "engine")
    _check(cfg.rollout.batch_size >= 1, "rollout.batch_size", "must be >= 1.")
    _check(cfg.rollout.kv_cache_mb > 0, "rollout.kv_cache_mb", "must be > 0.")
    _check(cfg.rollout.n >= 1, "rollout.n", "must be >= 1.")
    _check(cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy).")
    _check(0 < cfg.rollout.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {cfg.rollout.top_p}.")
    _check(cfg.rollout.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off).")
    _check(0 <= cfg.rollout.min_p < 1, "rollout.min_p", f"must be in [0, 1), got {cfg.rollout.min_p}.")
    _check(cfg.rollout.repetition_penalty > 0, "rollout.repetition_penalty", "must be > 0 (1 = off).")
    _one_of(cfg.rollout.logprobs_mode, ("raw", "processed"), "rollout.logprobs_mode", "logprobs mode")
    _check(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1.")
    _check(cfg.rollout.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1.")
    _check(cfg.rollout.max_num_batched_tokens >= 1, "rollout.max_num_batched_tokens", "must be >= 1.")
    _one_of(cfg.model.router_dtype, ("float32", "model"), "model.router_dtype", "router dtype")
    _check_quantization(cfg)
    _check_agent(cfg)
    if cfg.rollout.engine == "vllm":
        _check_vllm(cfg)
    _check(
        not cfg.rollout.free_memory_during_train or cfg.run.mode == "sync",
        "rollout.free_memory_during_train",
        f"needs run.mode=sync (it is {cfg.run.mode!r}): a sleeping engine cannot generate while the "
        "trainer trains, which is what the other modes overlap.",
    )
    if cfg.run.deterministic:
        _check_deterministic(cfg)
    _one_of(cfg.run.wandb_mode, ("online", "offline"), "run.wandb_mode", "W&B mode")
    _check(cfg.run.save_every >= 0, "run.save_every", "must be >= 0 (0 = only the final checkpoint).")
    _check(cfg.run.keep_checkpoints >= 0, "run.keep_checkpoints", "must be >= 0 (0 = keep all).")
    _check(cfg.train.warmup_steps >= 0, "train.warmup_steps", "must be >= 0.")
    _check(cfg.data.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1.")
    if not cfg.data.train_files:
        _one_of(cfg.data.task, TASKS.names(), "data.task", "task")
        _check(cfg.data.train_size >= 1, "data.train_size", f"must be >= 1, got {cfg.data.train_size}.")
    _check(cfg.data.val_size >= 0, "data.val_size", f"must be >= 0, got {cfg.data.val_size}.")
    _check(cfg.reward.num_workers >= 1, "reward.num_workers", "must be >= 1.")
    _check(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds.")
    _check(cfg.reward.import_timeout_s > 0, "reward.import_timeout_s", "must be > 0 seconds.")
    _check(cfg.reward.max_abs > 0, "reward.max_abs", "must be > 0 (the largest |reward| trained on).")
    _check(
        0 <= cfg.reward.overlong_buffer < cfg.rollout.max_new_tokens,
        "reward.overlong_buffer",
        f"must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}) (0 = off), got "
        f"{cfg.reward.overlong_buffer}.",
    )
    _check(cfg.reward.overlong_penalty >= 0, "reward.overlong_penalty", "must be >= 0.")
    _check(cfg.reward.sandbox_timeout_s > 0, "reward.sandbox_timeout_s", "must be > 0 seconds.")
    _check(
        cfg.reward.sandbox_memory_mb >= 32,
        "reward.sandbox_memory_mb",
        f"must be >= 32 (MiB of address space per test), got {cfg.reward.sandbox_memory_mb}.",
    )
    _one_of(cfg.algo.adv_estimator, ADV_ESTIMATORS.names(), "algo.adv_estimator", "advantage estimator")
    _one_of(cfg.algo.policy_loss, POLICY_LOSSES.names(), "algo.policy_loss", "policy loss")
    _one_of(cfg.algo.kl_estimator, KL_ESTIMATORS.names(), "algo.kl_estimator", "KL estimator")
    _one_of(cfg.algo.loss_agg, LOSS_AGGS.names(), "algo.loss_agg", "loss aggregation")
    _check(0 <= cfg.algo.clip_low < 1, "algo.clip_low", f"must be in [0, 1), got {cfg.algo.clip_low}.")
    _check(cfg.algo.clip_high >= 0, "algo.clip_high", f"must be >= 0, got {cfg.algo.clip_high}.")
    _check(cfg.algo.clip_c is None or cfg.algo.clip_c > 1, "algo.clip_c", "must be > 1 (or null to disable).")
    _check_corrections(cfg)
    _check(cfg.algo.max_filter_rounds >= 1, "algo.max_filter_rounds", "must be >= 1.")
    _check(0 <= cfg.algo.gamma <= 1, "algo.gamma", f"must be in [0, 1], got {cfg.algo.gamma}.")
    _check(0 <= cfg.algo.lam <= 1, "algo.lam", f"must be in [0, 1], got {cfg.algo.lam}.")
    _check(cfg.critic.lr > 0, "critic.lr", "must be > 0.")
    _check(cfg.critic.vf_clip > 0, "critic.vf_clip", "must be > 0.")
    _check(
        not cfg.algo.filter_groups or cfg.rollout.n >= 2,
        "algo.filter_groups",
        "needs rollout.n >= 2: a group of one always has equal rewards and would always be dropped.",
    )
    _check(cfg.algo.kl_coef >= 0, "algo.kl_coef", f"must be >= 0 (0 = off), got {cfg.algo.kl_coef}.")
    _check(cfg.train.lr > 0, "train.lr", "must be > 0.")
    _check(cfg.train.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {cfg.train.weight_decay}.")
    _check(
        0 <= cfg.train.min_lr_ratio <= 1,
        "train.min_lr_ratio",
        f"must be in [0, 1] (of train.lr), got {cfg.train.min_lr_ratio}.",
    )
    _one_of(cfg.train.schedule, SCHEDULES, "train.schedule", "LR schedule")
    _check(len(cfg.train.betas) == 2, "train.betas", "must be two numbers, e.g. [0.9, 0.999].")
    _check(cfg.train.epochs >= 1, "train.epochs", "must be >= 1.")
    _check(cfg.train.mini_batch_size >= 0, "train.mini_batch_size", "must be >= 0 (0 = whole batch).")
    _check(cfg.train.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1.")
    _check(0 <= cfg.sft.flawed_fraction <= 1, "sft.flawed_fraction", "must be in [0, 1].")
    # Against data.train_size only in run_sft: `tandem train` with a small data.train_size is fine.
    _check(cfg.sft.batch_size >= 1, "sft.batch_size", "must be >= 1.")
    _one_of(cfg.sft.model_type, ("qwen2", "qwen3_moe"), "sft.model_type", "fresh model family")
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


def _check_run_name(name: str) -> None:
    """run.name is one directory under run.out_dir: never the directory itself, its parent, or deeper."""
    seps = {"/", os.sep, os.altsep or "/", "\0"}
    _check(
        name.strip() not in ("", ".", "..") and not seps & set(name) and len(name.encode()) <= 255,
        "run.name",
        f"is {name!r}, not a usable directory name: the run writes to run.out_dir/run.name, so the name "
        "must be one non-empty directory name (no '/', not '.' or '..', at most 255 bytes), e.g. "
        "run.name=addition-grpo.",
    )


def check_training(cfg: Config) -> None:
    """What only a training run needs (`tandem generate` loads the same config with rollout.n=1)."""
    from tandem.algo import ADV_ESTIMATORS

    name = cfg.algo.adv_estimator
    if cfg.rollout.n == 1 and not learns_from_single_samples(name):
        works = [n for n in ADV_ESTIMATORS.names() if learns_from_single_samples(n)]
        raise TandemError(
            f"Config 'rollout.n' is 1, but algo.adv_estimator={name!r} takes its baseline from the other "
            "samples of a prompt's group: with one sample per group every advantage is 0 and the run "
            f"learns nothing. Set rollout.n >= 2, or an estimator that works with one sample: "
            f"{', '.join(works)}."
        )


def learns_from_single_samples(name: str) -> bool:
    """Whether estimator `name` gives any advantage when every group holds one sample: it is asked,
    on two groups of one with rewards 0 and 1 (and a critic's values of 0, for one that takes them)."""
    import torch

    from tandem.algo import ADV_ESTIMATORS

    estimator = ADV_ESTIMATORS.get(name)
    mask = torch.ones(2, 1)
    values = {"values": torch.zeros(2, 1)} if "values" in inspect.signature(estimator).parameters else {}
    return bool(estimator(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), mask, **values).any())


def _check_train_precision(cfg: Config) -> None:
    t = cfg.train
    what = "train compute dtype (float16 would need loss scaling: use bfloat16)"
    _one_of(t.dtype, TRAIN_DTYPES, "train.dtype", what)
    _one_of(t.strategy, STRATEGIES, "train.strategy", "training strategy")
    _one_of(t.offload, OFFLOADS, "train.offload", "offload policy")
    _check(
        t.offload == "none" or t.strategy == "fsdp2",
        "train.offload",
        f"is {t.offload!r}, which is FSDP2's CPU offload: set train.strategy=fsdp2 as well.",
    )


def _check_vllm(cfg: Config) -> None:
    """What rollout.engine=vllm adds: its memory share, and logprobs vLLM can record (whether vLLM is
    installed is checked when the run starts, so a config still loads on a machine without it)."""
    from tandem.rollout.protocol import SamplingParams
    from tandem.rollout.vllm_config import choose_logprobs_mode

    r = cfg.rollout
    _check(
        0 < r.vllm_gpu_memory_utilization <= 1,
        "rollout.vllm_gpu_memory_utilization",
        f"must be in (0, 1], got {r.vllm_gpu_memory_utilization}.",
    )
    calls = [
        SamplingParams(
            temperature=t,
            top_p=r.top_p,
            top_k=r.top_k,
            min_p=r.min_p,
            repetition_penalty=r.repetition_penalty,
            logprobs_mode=r.logprobs_mode,
        )
        for t in (r.temperature, r.val_temperature)
    ]
    try:
        choose_logprobs_mode(calls)
    except ValueError as e:
        raise TandemError(f"Config 'rollout.logprobs_mode' with rollout.engine=vllm: {e}") from None


def _check_corrections(cfg: Config) -> None:
    from tandem.algo.corrections import CORRECTIONS, IMPORTANCE_WEIGHTS

    a = cfg.algo
    for name in a.corrections:
        _one_of(name, CORRECTIONS.names(), "algo.corrections", "correction")
    _check(
        len(set(a.corrections)) == len(a.corrections),
        "algo.corrections",
        f"names one twice: {a.corrections}.",
    )
    weights = [n for n in a.corrections if n in IMPORTANCE_WEIGHTS]
    if "bypass" in a.corrections:
        _check(
            not weights,
            "algo.corrections",
            f"combines bypass with {', '.join(weights)}: bypass makes π_old the engine's logprob μ, so "
            "there is no π_old/μ left to weight by (decoupled would need π_prox). Keep one.",
        )
    _check(
        len(weights) <= 1,
        "algo.corrections",
        f"combines {', '.join(weights)}: each weights the loss by π_old/μ, so together they apply it "
        "twice. Keep one (opsm combines with any).",
    )
    _check(
        a.correction_cap is None or a.correction_cap > 0,
        "algo.correction_cap",
        f"must be > 0 (or null for no cap), got {a.correction_cap}.",
    )
    _check(
        0 <= a.mis_low <= 1 <= a.mis_high,
        "algo.mis_low",
        f"and algo.mis_high must satisfy 0 <= mis_low <= 1 <= mis_high so on-policy tokens (ratio 1) "
        f"are kept, got [{a.mis_low}, {a.mis_high}].",
    )
    _check(a.opsm_delta >= 0, "algo.opsm_delta", f"must be >= 0, got {a.opsm_delta}.")
    _one_of(a.prox_logprob, PROX_LOGPROBS, "algo.prox_logprob", "proximal-logprob method")
    _check(
        a.prox_logprob == "recompute" or "decoupled" in a.corrections,
        "algo.prox_logprob",
        f"is {a.prox_logprob!r}, which only decoupled PPO uses: add decoupled to algo.corrections.",
    )


def _check_placement(cfg: Config) -> None:
    p = cfg.placement
    _check(p.num_cpus >= 0, "placement.num_cpus", "must be >= 0 (0 = all the cluster has).")
    _check(p.num_gpus >= 0, "placement.num_gpus", "must be >= 0 (0 = all the cluster has).")
    _check(
        not p.num_gpus or cfg.run.device != "cpu",
        "placement.num_gpus",
        f"is {p.num_gpus:g}, but run.device=cpu puts nothing on a GPU: set run.device=cuda (or auto), "
        "or placement.num_gpus=0.",
    )
    if not p.groups:
        _check(not p.ratios, "placement.ratios", "needs placement.groups (one ratio per task group).")
        return
    tasks = [t for g in p.groups for t in ([g] if isinstance(g, str) else g)]
    for t in tasks:
        _one_of(t, TASKS, "placement.groups", "task")
    _check(len(tasks) == len(set(tasks)), "placement.groups", f"names a task twice: {p.groups}.")
    for needed in ("generate", "actor_train"):
        _check(needed in tasks, "placement.groups", f"must place '{needed}'; got {p.groups}.")
    if "logp" in tasks:
        group = next(g for g in p.groups if "logp" in ([g] if isinstance(g, str) else g))
        _check(
            "actor_train" in group,
            "placement.groups",
            "must put 'logp' in the same group as 'actor_train': the train workers recompute the "
            "old logprobs on their own weights.",
        )
    _check(
        len(p.ratios) == len(p.groups),
        "placement.ratios",
        f"needs one ratio per task group: {len(p.groups)} groups, {len(p.ratios)} ratios.",
    )
    _check(all(r > 0 for r in p.ratios), "placement.ratios", f"must all be > 0, got {p.ratios}.")
    _check(abs(sum(p.ratios) - 1) < 1e-6, "placement.ratios", f"must add up to 1, got {sum(p.ratios)}.")


def _check_agent(cfg: Config) -> None:
    """rollout.agent names a registered agent or a loadable pkg.module:Class; its tools exist."""
    from tandem.agent import TOOLS, agent_class

    r = cfg.rollout
    try:
        agent_class(r.agent)
    except TandemError as e:
        raise TandemError(f"Config 'rollout.agent': {e}") from None
    _check(r.max_turns >= 1, "rollout.max_turns", f"must be >= 1 (calls per episode), got {r.max_turns}.")
    for name in r.tools:
        _one_of(name, TOOLS.names(), "rollout.tools", "tool")
    _check(len(set(r.tools)) == len(r.tools), "rollout.tools", f"names a tool twice: {r.tools}.")
    _check(
        r.agent == "single_turn" or r.length_tail_alpha == 0,
        "rollout.length_tail_alpha",
        f"needs rollout.agent=single_turn (it is {r.agent!r}): decoding past EOS turns stop strings "
        "off, so no tool call would ever end a turn.",
    )


def _check_quantization(cfg: Config) -> None:
    r = cfg.rollout
    _one_of(r.quantization, ("none", "fp8"), "rollout.quantization", "rollout quantization")
    _one_of(r.fp8_scale, ("fp32", "ue8m0"), "rollout.fp8_scale", "FP8 scale format")
    _check(
        r.quantization == "none" or r.engine != "vllm",
        "rollout.quantization",
        "=fp8 is the built-in engines' blockwise FP8 (rollout.engine=builtin or paged); for vLLM pass "
        "its own quantization through its engine arguments.",
    )
    _check(
        r.quantization == "none" or not cfg.run.deterministic,
        "rollout.quantization",
        "=fp8 cannot run with run.deterministic=true: the batch-invariant kernels multiply the "
        "high-precision weights, so the fp8 copy would be bypassed (and an fp8 engine cannot match "
        "the trainer's logprobs bit for bit anyway).",
    )
    _check(
        not cfg.algo.routing_replay or r.engine != "vllm",
        "algo.routing_replay",
        "needs a built-in engine (rollout.engine=builtin or paged): they record the experts each token "
        "was routed to; the vLLM adapter does not.",
    )


def _check_deterministic(cfg: Config) -> None:
    """The settings a bit-reproducible run cannot have, each refused with the reason."""
    _check(
        cfg.run.mode != "async",
        "run.deterministic",
        "cannot be reproduced with run.mode=async: streaming trains on whichever groups finish first, "
        "and with rollout.on_update=continue or abort a weight update lands at whatever token the "
        "engine has reached; both depend on timing. Use run.mode=sync or one_step_off "
        "(generate_ahead_steps=k gives async's overlap on a fixed schedule).",
    )
    _check(
        cfg.rollout.engine != "vllm",
        "run.deterministic",
        "needs a built-in engine (rollout.engine=builtin or paged): vLLM's kernels are not batch-invariant, "
        "so its logprobs differ from the trainer's.",
    )
    _check(
        not cfg.rollout.compile,
        "run.deterministic",
        "cannot use rollout.compile=true: Inductor's fused kernels round differently from the trainer's.",
    )
    _check(
        not cfg.algo.filter_groups or cfg.run.mode == "sync",
        "run.deterministic",
        "with algo.filter_groups needs run.mode=sync: in one_step_off the prompts that replace dropped "
        "groups start under whichever version is published when the drop is seen.",
    )


def _check_sim(cfg: Config) -> None:
    """`tandem simulate`'s section (docs/simulate.md); its calibration file is checked when read."""
    s = cfg.sim
    _check(all(g >= 1 for g in s.gpus), "sim.gpus", f"must be GPU counts >= 1 ([] = CPUs), got {s.gpus}.")
    for i, run in enumerate(s.runs):
        _check(
            len(run) >= 1 and "=" not in run[0],
            f"sim.runs[{i}]",
            f"must be [label, section.key=value, ...], got {run}.",
        )
    labels = [run[0] for run in s.runs] or ["sync", "one_step_off", "async"]
    _check(len(set(labels)) == len(labels), "sim.runs", f"has a label twice: {labels}.")
    _one_of(s.baseline, labels, "sim.baseline", "run label")
    _check(s.tensor_parallel >= 1, "sim.tensor_parallel", "must be >= 1 (GPUs per engine).")
    _check(s.generate_calls >= 1, "sim.generate_calls", "must be >= 1.")
    _check(0 < s.kv_memory_fraction <= 1, "sim.kv_memory_fraction", "must be in (0, 1].")
    _check(s.prompt_tokens >= 1, "sim.prompt_tokens", "must be >= 1.")
    _check(
        s.lengths in ("lognormal", "pareto") or s.lengths.startswith("metrics:"),
        "sim.lengths",
        f"is {s.lengths!r}; valid: lognormal, pareto, metrics:PATH (a run's metrics.jsonl).",
    )
    _check(s.length_mean > 0, "sim.length_mean", "must be > 0 tokens.")
    _check(s.length_sigma > 0, "sim.length_sigma", "must be > 0.")
    _check(s.length_alpha > 1, "sim.length_alpha", "must be > 1 (a Pareto with a finite mean).")
    _check(s.warmup_steps >= 0, "sim.warmup_steps", "must be >= 0.")
    _check(
        bool(s.search_ratios) and all(0 < r < 1 for r in s.search_ratios),
        "sim.search_ratios",
        f"must be rollout shares in (0, 1), got {s.search_ratios}.",
    )
    _check(
        bool(s.search_staleness) and all(k >= 0 for k in s.search_staleness),
        "sim.search_staleness",
        f"must be max_staleness values >= 0, got {s.search_staleness}.",
    )
