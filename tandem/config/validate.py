"""Value checks that types alone cannot express, one function per config section. Every error names
the field and what is valid.

The loader has checked the closed sets (the schema's `Literal`s). A name another module owns is
checked against its owner (`_check_names`), and what a check needs to know of the named entry (does
the estimator need a critic, can the engine run FP8, does a correction weight by π_old/μ) it asks
the entry's traits, never its name.
"""

import difflib
import os
from collections.abc import Sequence

import torch

from tandem.agent import TOOLS, agent_class
from tandem.agent.chat import TOOL_PARSERS
from tandem.algo import ADV_ESTIMATORS, CORRECTIONS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from tandem.config.sampling import sampling_params
from tandem.config.schema import LORA_ALL_LINEAR, Config
from tandem.data.reasoning_gym import PREFIX as REASONING_GYM
from tandem.data.tasks import TASKS, build_task
from tandem.dtypes import ROLLOUT_DTYPES, TRAIN_DTYPES
from tandem.errors import TandemError
from tandem.reward.judge import JUDGE_PARSERS, template_error
from tandem.rollout.engines import ENGINES
from tandem.rollout.protocol import ON_UPDATE_POLICIES
from tandem.runtime.role_table import one_process_reasons, placement_tasks, table
from tandem.sample import LOGPROBS_MODES
from tandem.sync.protocol import TRANSPORTS
from tandem.train.optim import SCHEDULES


def validate(cfg: Config) -> None:
    """Every section's checks; the names first, since the later checks ask the named entries' traits."""
    _check_names(cfg)
    for check in (
        _check_run,
        _check_rollout,
        _check_sampling,
        _check_engine,
        _check_agent,
        _check_sync,
        _check_placement,
        _check_task_groups,
        _check_sim,
        _check_sim_lengths,
        _check_data,
        _check_reward,
        _check_judge,
        _check_algo,
        _check_correction_set,
        _check_corrections,
        _check_critic,
        _check_train,
        _check_lora,
        _check_sft,
    ):
        check(cfg)
    if cfg.run.deterministic:
        _check_deterministic(cfg)
    if cfg.run.cluster == "local":
        why = one_process_refusal(cfg)
        _check(
            not why,
            "run.cluster",
            f"is local (a sync run's workers in one process), which this run cannot be: {why}.",
        )


def one_of(value: object, valid: Sequence[str], key: str, what: str) -> None:
    """TandemError naming the field, the valid names and the closest one, unless `value` is valid."""
    if value in valid:
        return
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    names = ", ".join(valid)
    raise TandemError(f"Config '{key}' is {value!r}, not a known {what}. Valid names: {names}.{hint}")


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise TandemError(f"Config '{key}' {message}")


def _check_names(cfg: Config) -> None:
    """Each name another module owns is one it knows: a registry's entry, or one of its tuple."""
    r, a = cfg.rollout, cfg.algo
    registered = [
        ("rollout.engine", r.engine, ENGINES),
        ("sync.transport", cfg.sync.transport, TRANSPORTS),
        ("algo.adv_estimator", a.adv_estimator, ADV_ESTIMATORS),
        ("algo.policy_loss", a.policy_loss, POLICY_LOSSES),
        ("algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS),
        ("algo.loss_agg", a.loss_agg, LOSS_AGGS),
        ("train.schedule", cfg.train.schedule, SCHEDULES),
        *[("algo.corrections", name, CORRECTIONS) for name in a.corrections],
        *[("rollout.tools", name, TOOLS) for name in r.tools],
    ]
    for key, value, registry in registered:
        one_of(value, registry.names(), key, registry.kind)
    one_of(r.on_update, ON_UPDATE_POLICIES, "rollout.on_update", "weight-update policy")
    one_of(r.logprobs_mode, LOGPROBS_MODES, "rollout.logprobs_mode", "logprobs mode")
    one_of(r.dtype, ROLLOUT_DTYPES, "rollout.dtype", "dtype")
    what = "train compute dtype (float16 would need loss scaling: use bfloat16)"
    one_of(cfg.train.dtype, TRAIN_DTYPES, "train.dtype", what)


def _check_run(cfg: Config) -> None:
    run = cfg.run
    _check_run_name(run.name)
    _check(run.steps >= 1, "run.steps", f"must be >= 1, got {run.steps}.")
    _check(run.threads >= 0, "run.threads", "must be >= 0 (0 = the CPUs each role's placement gives it).")
    _check(run.max_staleness >= 0, "run.max_staleness", "must be >= 0 (0 = on-policy).")
    _check(run.generate_ahead_steps >= 1, "run.generate_ahead_steps", "must be >= 1.")
    _check(run.timeout_s > 0, "run.timeout_s", "must be > 0 seconds.")
    _check(run.val_every >= 0, "run.val_every", "must be >= 0 (0 = validate only at start and end).")
    _check(run.save_every >= 0, "run.save_every", "must be >= 0 (0 = only the final checkpoint).")
    _check(run.keep_checkpoints >= 0, "run.keep_checkpoints", "must be >= 0 (0 = keep all).")


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


def _check_rollout(cfg: Config) -> None:
    """The rollout workers' counts and sizes."""
    r = cfg.rollout
    _check(r.num_workers >= 1, "rollout.num_workers", "must be >= 1.")
    _check(r.chunk_groups >= 1, "rollout.chunk_groups", "must be >= 1.")
    _check(r.calls_per_worker >= 1, "rollout.calls_per_worker", "must be >= 1.")
    _check(r.length_tail_alpha >= 0, "rollout.length_tail_alpha", "must be >= 0 (0 = off).")
    _check(r.batch_size >= 1, "rollout.batch_size", "must be >= 1.")
    _check(r.n >= 1, "rollout.n", "must be >= 1.")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1.")
    _check(r.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1.")
    _check(r.max_num_batched_tokens >= 1, "rollout.max_num_batched_tokens", "must be >= 1.")
    _check(r.kv_cache_mb > 0, "rollout.kv_cache_mb", "must be > 0.")
    _check(
        0 < r.vllm_gpu_memory_utilization <= 1,
        "rollout.vllm_gpu_memory_utilization",
        f"must be in (0, 1], got {r.vllm_gpu_memory_utilization}.",
    )
    _check(
        r.vllm_cpu_kv_cache_gib >= 1,
        "rollout.vllm_cpu_kv_cache_gib",
        "must be >= 1 (whole GiB: vLLM reads an integer).",
    )
    _check(
        not r.free_memory_during_train or cfg.run.mode == "sync",
        "rollout.free_memory_during_train",
        f"needs run.mode=sync (it is {cfg.run.mode!r}): a sleeping engine cannot generate while the "
        "trainer trains, which is what the other modes overlap.",
    )


def _check_sampling(cfg: Config) -> None:
    """The sampling parameters, and that the engine records the logprobs they ask for (vLLM's mode is
    fixed at its start: one must serve both training's and validation's calls)."""
    r = cfg.rollout
    _check(r.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy).")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}.")
    _check(r.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off).")
    _check(0 <= r.min_p < 1, "rollout.min_p", f"must be in [0, 1), got {r.min_p}.")
    _check(r.repetition_penalty > 0, "rollout.repetition_penalty", "must be > 0 (1 = off).")
    try:  # the calls the loop will make: what SamplingParams refuses fails here, not in the run
        calls = [sampling_params(cfg, t) for t in (r.temperature, r.val_temperature)]
    except ValueError as e:
        raise TandemError(f"Config 'rollout' sampling settings: {e}.") from None
    try:
        ENGINES.get(r.engine).check_sampling(calls)
    except ValueError as e:
        raise TandemError(f"Config 'rollout.logprobs_mode' with rollout.engine={r.engine}: {e}") from None


def _engines_with(trait: str) -> str:
    """The engines whose spec has `trait`, as a setting to write: "builtin or paged"."""
    return " or ".join(name for name in ENGINES.names() if getattr(ENGINES.get(name), trait))


def _check_engine(cfg: Config) -> None:
    """What the settings ask of the engine, against its traits (tandem.rollout.engines)."""
    r, spec = cfg.rollout, ENGINES.get(cfg.rollout.engine)
    _check(
        r.quantization == "none" or spec.fp8,
        "rollout.quantization",
        f"=fp8 needs an engine with FP8 weights (rollout.engine={_engines_with('fp8')}: tandem's "
        f"blockwise FP8 in the built-in engines, vLLM's own on a GPU); rollout.engine={r.engine} has "
        "none here (vLLM's CPU build: vLLM's FP8 runs on its CUDA kernels).",
    )
    _check(
        r.quantization == "none" or not cfg.run.deterministic,
        "rollout.quantization",
        "=fp8 cannot run with run.deterministic=true: the batch-invariant kernels multiply the "
        "high-precision weights, so the fp8 copy would be bypassed (and an fp8 engine cannot match "
        "the trainer's logprobs bit for bit anyway).",
    )
    _check(
        not r.compile or spec.torch_compile,
        "rollout.compile",
        f"=true compiles the built-in engines' decode step "
        f"(rollout.engine={_engines_with('torch_compile')}); "
        f"rollout.engine={r.engine} compiles its own graph (vLLM: unless rollout.vllm_enforce_eager=true).",
    )
    _check(
        not cfg.algo.routing_replay or spec.records_routing,
        "algo.routing_replay",
        f"needs an engine that records the experts each token was routed to "
        f"(rollout.engine={_engines_with('records_routing')}); rollout.engine={r.engine} does not.",
    )


def _check_agent(cfg: Config) -> None:
    """rollout.agent names a registered agent or a loadable pkg.module:Class (its tools: _check_names)."""
    r = cfg.rollout
    try:
        agent_class(r.agent)
    except TandemError as e:
        raise TandemError(f"Config 'rollout.agent': {e}") from None
    _check(r.max_turns >= 1, "rollout.max_turns", f"must be >= 1 (calls per episode), got {r.max_turns}.")
    _check(r.agent_timeout_s > 0, "rollout.agent_timeout_s", f"must be > 0 seconds, got {r.agent_timeout_s}.")
    _check(
        r.tool_parser in TOOL_PARSERS,
        "rollout.tool_parser",
        f"is {r.tool_parser!r}; valid: {', '.join(TOOL_PARSERS.names())}.",
    )
    _check(len(set(r.tools)) == len(r.tools), "rollout.tools", f"names a tool twice: {r.tools}.")
    _check(
        r.agent == "single_turn" or r.length_tail_alpha == 0,
        "rollout.length_tail_alpha",
        f"needs rollout.agent=single_turn (it is {r.agent!r}): decoding past EOS turns stop strings "
        "off, so no tool call would ever end a turn.",
    )


def _check_sync(cfg: Config) -> None:
    s, run = cfg.sync, cfg.run
    _check(s.produce_bucket_mb > 0, "sync.produce_bucket_mb", "must be > 0.")
    _check(s.consume_bucket_mb > 0, "sync.consume_bucket_mb", "must be > 0.")
    _check(s.timeout_s > 0, "sync.timeout_s", "must be > 0 seconds.")
    _check(s.every >= 1, "sync.every", "must be >= 1 (train steps between weight pushes).")
    _check(
        s.every == 1 or (run.mode == "async" and run.max_staleness >= s.every - 1),
        "sync.every",
        f"is {s.every}: pushing every N steps needs run.mode=async with run.max_staleness >= N - 1 "
        f"(got mode {run.mode!r}, max_staleness {run.max_staleness}), or the buffer could not "
        "admit the groups the steps between two pushes train on.",
    )


def _check_placement(cfg: Config) -> None:
    """The resources roles are placed on."""
    p = cfg.placement
    _check(cfg.ray.num_cpus >= 0, "ray.num_cpus", "must be >= 0 (0 = every core).")
    _check(p.num_cpus >= 0, "placement.num_cpus", "must be >= 0 (0 = all the cluster has).")
    _check(p.num_gpus >= 0, "placement.num_gpus", "must be >= 0 (0 = all the cluster has).")
    _check(
        not p.num_gpus or cfg.run.device != "cpu",
        "placement.num_gpus",
        f"is {p.num_gpus:g}, but run.device=cpu puts nothing on a GPU: set run.device=cuda (or auto), "
        "or placement.num_gpus=0.",
    )


def _check_task_groups(cfg: Config) -> None:
    """placement.groups names each task once, places the two every run has, and has one ratio each."""
    p = cfg.placement
    if not p.groups:
        _check(not p.ratios, "placement.ratios", "needs placement.groups (one ratio per task group).")
        return
    groups = [[g] if isinstance(g, str) else g for g in p.groups]
    tasks = [t for g in groups for t in g]
    for t in tasks:
        one_of(t, placement_tasks(), "placement.groups", "task")
    _check(len(tasks) == len(set(tasks)), "placement.groups", f"names a task twice: {p.groups}.")
    for needed in (r.task for r in table() if r.task and not r.placed_with):
        _check(needed in tasks, "placement.groups", f"must place '{needed}'; got {p.groups}.")
    _check(
        all("actor_train" in g for g in groups if "logp" in g),
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
    one_of(s.baseline, labels, "sim.baseline", "run label")
    _check(s.tensor_parallel >= 1, "sim.tensor_parallel", "must be >= 1 (GPUs per engine).")
    _check(s.generate_calls >= 1, "sim.generate_calls", "must be >= 1.")
    _check(0 < s.kv_memory_fraction <= 1, "sim.kv_memory_fraction", "must be in (0, 1].")
    _check(s.prompt_tokens >= 1, "sim.prompt_tokens", "must be >= 1.")
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


def _check_sim_lengths(cfg: Config) -> None:
    """The simulated response lengths' distribution."""
    s = cfg.sim
    _check(
        s.lengths in ("lognormal", "pareto") or s.lengths.startswith(("metrics:", "file:")),
        "sim.lengths",
        f"is {s.lengths!r}; valid: lognormal, pareto, metrics:PATH (a run's metrics.jsonl), "
        "file:PATH (measured response lengths).",
    )
    _check(s.length_mean > 0, "sim.length_mean", "must be > 0 tokens.")
    _check(s.length_sigma > 0, "sim.length_sigma", "must be > 0.")
    _check(s.length_alpha > 1, "sim.length_alpha", "must be > 1 (a Pareto with a finite mean).")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _check(d.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1.")
    if not d.train_files:  # the synthetic task's rows
        _check_task(d.task, d.task_config)
        _check(d.train_size >= 1, "data.train_size", f"must be >= 1, got {d.train_size}.")
    else:
        _check(
            not d.task_config,
            "data.task_config",
            "is set, but data.train_files are given, so no synthetic task runs. Drop one of them.",
        )
    _check(d.val_size >= 0, "data.val_size", f"must be >= 0, got {d.val_size}.")


def _check_task(task: str, task_config: dict) -> None:
    """The task's name, and its arguments by building it (a reasoning-gym dataset: imports it, and
    its config checked by reasoning-gym's own config class)."""
    if not task.startswith(REASONING_GYM):
        one_of(task, [*TASKS.names(), f"{REASONING_GYM}<dataset>"], "data.task", TASKS.kind)
    build_task(task, task_config)


def _check_reward(cfg: Config) -> None:
    w = cfg.reward
    _check(w.num_workers >= 1, "reward.num_workers", "must be >= 1.")
    _check(w.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds.")
    _check(w.import_timeout_s > 0, "reward.import_timeout_s", "must be > 0 seconds.")
    _check(w.max_abs > 0, "reward.max_abs", "must be > 0 (the largest |reward| trained on).")
    _check(
        0 <= w.overlong_buffer < cfg.rollout.max_new_tokens,
        "reward.overlong_buffer",
        f"must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}) (0 = off), got "
        f"{w.overlong_buffer}.",
    )
    _check(w.overlong_penalty >= 0, "reward.overlong_penalty", "must be >= 0.")
    _check(w.sandbox_timeout_s > 0, "reward.sandbox_timeout_s", "must be > 0 seconds.")
    _check(
        w.sandbox_memory_mb >= 32,
        "reward.sandbox_memory_mb",
        f"must be >= 32 (MiB of address space per test), got {w.sandbox_memory_mb}.",
    )


def _check_judge(cfg: Config) -> None:
    """reward.fn=judge needs a judge (a model, a template, a parser); a judge without it is refused,
    not ignored."""
    w, j = cfg.reward, cfg.reward.judge
    if w.fn != "judge":
        _check(
            not j.path,
            "reward.judge.path",
            f"is {j.path!r}, but reward.fn={w.fn!r} never asks a judge: set reward.fn=judge to score "
            "with it, or leave reward.judge.path empty.",
        )
        return
    _check(
        bool(j.path),
        "reward.judge.path",
        "must name the judge model with reward.fn=judge: its checkpoint directory or builtin:<name>.",
    )
    one_of(j.parser, JUDGE_PARSERS.names(), "reward.judge.parser", JUDGE_PARSERS.kind)
    why = template_error(j.template)
    _check(not why, "reward.judge.template", f"{why} It is {j.template!r}.")
    _check(j.max_new_tokens >= 1, "reward.judge.max_new_tokens", "must be >= 1.")
    _check(j.timeout_s > 0, "reward.judge.timeout_s", "must be > 0 seconds.")
    _check(
        j.verifier not in ("", "judge"),
        "reward.judge.verifier",
        f"is {j.verifier!r}: it must be a reward spec other than judge (e.g. auto), which scores the "
        "held-out samples, so that val/accuracy stays a verifier's accuracy.",
    )


def _check_algo(cfg: Config) -> None:
    a = cfg.algo
    if a.distill.teacher:
        _check(a.distill.coef > 0, "algo.distill.coef", f"must be > 0, got {a.distill.coef}.")
        _check(
            not ADV_ESTIMATORS.traits(a.adv_estimator).needs_critic,
            "algo.distill.teacher",
            f"cannot be used with algo.adv_estimator={a.adv_estimator}: its critic's advantages and "
            "the teacher's per-token ones are two answers to one question. Use grpo (or another "
            "group estimator), with algo.distill.task_reward=true to add the task's signal.",
        )
    _check(0 <= a.clip_low < 1, "algo.clip_low", f"must be in [0, 1), got {a.clip_low}.")
    _check(a.clip_high >= 0, "algo.clip_high", f"must be >= 0, got {a.clip_high}.")
    _check(a.clip_c is None or a.clip_c > 1, "algo.clip_c", "must be > 1 (or null to disable).")
    _check(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0 (0 = off), got {a.kl_coef}.")
    _check(a.max_filter_rounds >= 1, "algo.max_filter_rounds", "must be >= 1.")
    _check(
        not a.filter_groups or cfg.rollout.n >= 2,
        "algo.filter_groups",
        "needs rollout.n >= 2: a group of one always has equal rewards and would always be dropped.",
    )
    _check(0 <= a.gamma <= 1, "algo.gamma", f"must be in [0, 1], got {a.gamma}.")
    _check(0 <= a.lam <= 1, "algo.lam", f"must be in [0, 1], got {a.lam}.")


def _check_correction_set(cfg: Config) -> None:
    """algo.corrections combine: no entry twice, and at most one weight by π_old/μ, which none may
    apply once bypass has made π_old the engine's μ (each entry's `CorrectionTraits`)."""
    names = cfg.algo.corrections
    _check(len(set(names)) == len(names), "algo.corrections", f"names one twice: {names}.")
    weights = [n for n in names if CORRECTIONS.traits(n).weights]
    for bypass in [n for n in names if CORRECTIONS.traits(n).old_is_behaviour]:
        _check(
            not weights,
            "algo.corrections",
            f"combines {bypass} with {', '.join(weights)}: {bypass} makes π_old the engine's logprob μ, "
            "so there is no π_old/μ (nor a π_prox/μ) left to weight by. Keep one.",
        )
    _check(
        len(weights) <= 1,
        "algo.corrections",
        f"combines {', '.join(weights)}: each weights the loss by π_old/μ, so together they apply it "
        "twice. Keep one (one that only masks combines with any).",
    )


def _check_corrections(cfg: Config) -> None:
    """The corrections' options."""
    a = cfg.algo
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
    proximal = [n for n in CORRECTIONS.names() if CORRECTIONS.traits(n).old_is_prox]
    _check(
        a.prox_logprob == "recompute" or any(n in proximal for n in a.corrections),
        "algo.prox_logprob",
        f"is {a.prox_logprob!r}, which only a correction against a proximal policy uses: add "
        f"{' or '.join(proximal)} to algo.corrections.",
    )


def _check_critic(cfg: Config) -> None:
    """The value model of an estimator that needs one (the rest of its training follows `train`)."""
    _check(cfg.critic.lr > 0, "critic.lr", "must be > 0.")
    _check(cfg.critic.vf_clip > 0, "critic.vf_clip", "must be > 0.")


def _check_train(cfg: Config) -> None:
    t = cfg.train
    _check(t.num_workers >= 1, "train.num_workers", "must be >= 1.")
    _check(t.lr > 0, "train.lr", "must be > 0.")
    _check(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0.")
    _check(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}.")
    _check(
        0 <= t.min_lr_ratio <= 1,
        "train.min_lr_ratio",
        f"must be in [0, 1] (of train.lr), got {t.min_lr_ratio}.",
    )
    _check(len(t.betas) == 2, "train.betas", "must be two numbers, e.g. [0.9, 0.999].")
    _check(t.epochs >= 1, "train.epochs", "must be >= 1.")
    _check(t.mini_batch_size >= 0, "train.mini_batch_size", "must be >= 0 (0 = whole batch).")
    _check(t.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1.")
    _check(
        t.offload == "none" or t.strategy == "fsdp2",
        "train.offload",
        f"is {t.offload!r}, which is FSDP2's CPU offload: set train.strategy=fsdp2 as well.",
    )


def _check_lora(cfg: Config) -> None:
    """train.lora's values, and what adapters cannot run with. Its targets are checked against the
    model's modules before any actor starts (`tandem.model.lora.check_lora`, in `build_data`)."""
    lora = cfg.train.lora
    _check(
        lora.rank >= 0, "train.lora.rank", f"must be >= 0 (0 = off: every weight trains), got {lora.rank}."
    )
    _check(
        lora.alpha > 0,
        "train.lora.alpha",
        f"must be > 0 (the update is scaled by alpha / rank), got {lora.alpha}.",
    )
    _check(0 <= lora.dropout < 1, "train.lora.dropout", f"must be in [0, 1), got {lora.dropout}.")
    targets = lora.target_modules
    _check(
        targets == LORA_ALL_LINEAR if isinstance(targets, str) else bool(targets) and all(targets),
        "train.lora.target_modules",
        f"is {targets!r}: give a list of module names, e.g. [q_proj, v_proj] (a module whose name is one "
        f"of them or ends in '.' + one gets an adapter, as in PEFT), or {LORA_ALL_LINEAR}. A single name "
        "is a list of one: [q_proj].",
    )
    _check(
        all(lora.modules_to_save),
        "train.lora.modules_to_save",
        f"holds an empty name: {lora.modules_to_save}.",
    )
    if not lora.rank:
        return
    ENGINES.get(cfg.rollout.engine).check_lora(lora.rank, lora.modules_to_save)
    _check(
        not cfg.run.deterministic or lora.dropout == 0,
        "train.lora.dropout",
        f"is {lora.dropout} with run.deterministic=true: the batch-invariant forward multiplies by each "
        "adapted weight merged with its adapter (as the engines do), which has no form that drops "
        "the adapter's inputs alone. Set train.lora.dropout=0.",
    )
    _check(
        not lora.modules_to_save or cfg.algo.kl_coef == 0,
        "train.lora.modules_to_save",
        f"is {lora.modules_to_save} with algo.kl_coef={cfg.algo.kl_coef}: the KL term's reference is the "
        "policy with its adapters off, and a module trained whole has no original left to turn back "
        "to. Train adapters only (modules_to_save=[]) or drop the KL term.",
    )
    groups = [t for g in cfg.placement.groups for t in ([g] if isinstance(g, str) else g)]
    _check(
        "ref_logp" not in groups,
        "placement.groups",
        "places ref_logp, but with train.lora.rank > 0 there is no reference worker: the reference "
        "policy is the train workers' own model with its adapters off. Leave ref_logp out.",
    )


def _check_sft(cfg: Config) -> None:
    s = cfg.sft
    _check(0 <= s.flawed_fraction <= 1, "sft.flawed_fraction", "must be in [0, 1].")
    # Against data.train_size only in run_sft: `tandem train` with a small data.train_size is fine.
    _check(s.batch_size >= 1, "sft.batch_size", "must be >= 1.")
    _check(
        s.hidden_size % s.num_attention_heads == 0,
        "sft.hidden_size",
        "must be divisible by sft.num_attention_heads.",
    )
    _check(
        s.num_attention_heads % s.num_key_value_heads == 0,
        "sft.num_key_value_heads",
        "must divide sft.num_attention_heads.",
    )


def one_process_refusal(cfg: Config) -> str:
    """ "" where the run can be held in one process (`tandem.runtime.local`), else why not: it needs
    sync mode (nothing overlaps), one worker per role, no torch.distributed world (fsdp2, the
    broadcast transport), the built-in engines (vLLM brings processes of its own and runs on Ray
    only) and no Ray cluster to join."""
    t = cfg.train
    reasons = [
        (cfg.run.mode != "sync", f"run.mode={cfg.run.mode} overlaps generation and training"),
        *((True, why) for why in one_process_reasons(cfg)),
        (t.strategy == "fsdp2", "train.strategy=fsdp2 needs a torch.distributed world"),
        (TRANSPORTS.get(cfg.sync.transport).collective, f"sync.transport={cfg.sync.transport}"),
        (not ENGINES.get(cfg.rollout.engine).one_process, f"rollout.engine={cfg.rollout.engine}"),
        (bool(cfg.ray.address), f"ray.address={cfg.ray.address}"),
    ]
    return "; ".join(why for no, why in reasons if no)


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
        ENGINES.get(cfg.rollout.engine).batch_invariant,
        "run.deterministic",
        f"needs an engine with a batch-invariant forward (rollout.engine="
        f"{_engines_with('batch_invariant')}): rollout.engine={cfg.rollout.engine}'s kernels are not "
        "batch-invariant, so its logprobs differ from the trainer's.",
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


def check_training(cfg: Config) -> None:
    """What only a training run needs (`tandem generate` loads the same config with rollout.n=1)."""
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
    on two groups of one with rewards 0 and 1 (and a critic's values of 0, for one that needs them)."""
    estimator = ADV_ESTIMATORS.get(name)
    mask = torch.ones(2, 1)
    values = {"values": torch.zeros(2, 1)} if ADV_ESTIMATORS.traits(name).needs_critic else {}
    return bool(estimator(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), mask, **values).any())
