"""Value checks that types alone cannot express, one function per config section. Every error names
the field and what is valid.

The loader has checked the closed sets (the schema's `Literal`s). A name another module owns is
checked against its owner (`_check_names`), and what a check needs to know of the named entry (does
the estimator need a critic, can the engine run FP8, does a correction weight by π_old/μ) it asks
the entry's traits, never its name.
"""

import os

from tandem.agent import TOOLS, agent_class
from tandem.agent.chat import TOOL_PARSERS
from tandem.algo import ADV_ESTIMATORS, CORRECTIONS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from tandem.config.loader import one_of, require
from tandem.config.sampling import sampling_params
from tandem.config.schema import Config
from tandem.data.reasoning_gym import PREFIX as REASONING_GYM
from tandem.data.tasks import TASKS, build_task
from tandem.dtypes import ROLLOUT_DTYPES, TRAIN_DTYPES
from tandem.errors import TandemError
from tandem.reward.judge import JUDGE_PARSERS, template_error
from tandem.rollout.engines import ENGINES, engines_with
from tandem.rollout.protocol import ON_UPDATE_POLICIES
from tandem.runtime.role_table import one_process_reasons, placement_tasks, table
from tandem.runtime.train_checks import (
    check_algo,
    check_correction_set,
    check_corrections,
    check_critic,
    check_deterministic,
    check_lora,
    check_sft,
    check_train,
)
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
        check_algo,
        check_correction_set,
        check_corrections,
        check_critic,
        check_train,
        check_lora,
        check_sft,
    ):
        check(cfg)
    if cfg.run.deterministic:
        check_deterministic(cfg)
    if cfg.run.cluster == "local":
        why = one_process_refusal(cfg)
        require(
            not why,
            "run.cluster",
            f"is local (a sync run's workers in one process), which this run cannot be: {why}.",
        )


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
    require(run.steps >= 1, "run.steps", f"must be >= 1, got {run.steps}.")
    require(run.threads >= 0, "run.threads", "must be >= 0 (0 = the CPUs each role's placement gives it).")
    require(run.max_staleness >= 0, "run.max_staleness", "must be >= 0 (0 = on-policy).")
    require(run.generate_ahead_steps >= 1, "run.generate_ahead_steps", "must be >= 1.")
    require(run.timeout_s > 0, "run.timeout_s", "must be > 0 seconds.")
    require(run.val_every >= 0, "run.val_every", "must be >= 0 (0 = validate only at start and end).")
    require(run.save_every >= 0, "run.save_every", "must be >= 0 (0 = only the final checkpoint).")
    require(run.keep_checkpoints >= 0, "run.keep_checkpoints", "must be >= 0 (0 = keep all).")


def _check_run_name(name: str) -> None:
    """run.name is one directory under run.out_dir: never the directory itself, its parent, or deeper."""
    seps = {"/", os.sep, os.altsep or "/", "\0"}
    require(
        name.strip() not in ("", ".", "..") and not seps & set(name) and len(name.encode()) <= 255,
        "run.name",
        f"is {name!r}, not a usable directory name: the run writes to run.out_dir/run.name, so the name "
        "must be one non-empty directory name (no '/', not '.' or '..', at most 255 bytes), e.g. "
        "run.name=addition-grpo.",
    )


def _check_rollout(cfg: Config) -> None:
    """The rollout workers' counts and sizes."""
    r = cfg.rollout
    require(r.num_workers >= 1, "rollout.num_workers", "must be >= 1.")
    require(r.chunk_groups >= 1, "rollout.chunk_groups", "must be >= 1.")
    require(r.calls_per_worker >= 1, "rollout.calls_per_worker", "must be >= 1.")
    require(r.length_tail_alpha >= 0, "rollout.length_tail_alpha", "must be >= 0 (0 = off).")
    require(r.batch_size >= 1, "rollout.batch_size", "must be >= 1.")
    require(r.n >= 1, "rollout.n", "must be >= 1.")
    require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1.")
    require(r.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1.")
    require(r.max_num_batched_tokens >= 1, "rollout.max_num_batched_tokens", "must be >= 1.")
    require(r.kv_cache_mb > 0, "rollout.kv_cache_mb", "must be > 0.")
    require(
        0 < r.vllm_gpu_memory_utilization <= 1,
        "rollout.vllm_gpu_memory_utilization",
        f"must be in (0, 1], got {r.vllm_gpu_memory_utilization}.",
    )
    require(
        r.vllm_cpu_kv_cache_gib >= 1,
        "rollout.vllm_cpu_kv_cache_gib",
        "must be >= 1 (whole GiB: vLLM reads an integer).",
    )
    require(
        not r.free_memory_during_train or cfg.run.mode == "sync",
        "rollout.free_memory_during_train",
        f"needs run.mode=sync (it is {cfg.run.mode!r}): a sleeping engine cannot generate while the "
        "trainer trains, which is what the other modes overlap.",
    )


def _check_sampling(cfg: Config) -> None:
    """The sampling parameters, and that the engine records the logprobs they ask for (vLLM's mode is
    fixed at its start: one must serve both training's and validation's calls)."""
    r = cfg.rollout
    require(r.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy).")
    require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}.")
    require(r.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off).")
    require(0 <= r.min_p < 1, "rollout.min_p", f"must be in [0, 1), got {r.min_p}.")
    require(r.repetition_penalty > 0, "rollout.repetition_penalty", "must be > 0 (1 = off).")
    try:  # the calls the loop will make: what SamplingParams refuses fails here, not in the run
        calls = [sampling_params(cfg, t) for t in (r.temperature, r.val_temperature)]
    except ValueError as e:
        raise TandemError(f"Config 'rollout' sampling settings: {e}.") from None
    try:
        ENGINES.get(r.engine).check_sampling(calls)
    except ValueError as e:
        raise TandemError(f"Config 'rollout.logprobs_mode' with rollout.engine={r.engine}: {e}") from None


def _check_engine(cfg: Config) -> None:
    """What the settings ask of the engine, against its traits (tandem.rollout.engines)."""
    r, spec = cfg.rollout, ENGINES.get(cfg.rollout.engine)
    require(
        r.quantization == "none" or spec.fp8,
        "rollout.quantization",
        f"=fp8 needs an engine with FP8 weights (rollout.engine={engines_with('fp8')}: tandem's "
        f"blockwise FP8 in the built-in engines, vLLM's own on a GPU); rollout.engine={r.engine} has "
        "none here (vLLM's CPU build: vLLM's FP8 runs on its CUDA kernels).",
    )
    require(
        r.quantization == "none" or not cfg.run.deterministic,
        "rollout.quantization",
        "=fp8 cannot run with run.deterministic=true: the batch-invariant kernels multiply the "
        "high-precision weights, so the fp8 copy would be bypassed (and an fp8 engine cannot match "
        "the trainer's logprobs bit for bit anyway).",
    )
    require(
        not r.compile or spec.torch_compile,
        "rollout.compile",
        f"=true compiles the built-in engines' decode step "
        f"(rollout.engine={engines_with('torch_compile')}); "
        f"rollout.engine={r.engine} compiles its own graph (vLLM: unless rollout.vllm_enforce_eager=true).",
    )
    require(
        not cfg.algo.routing_replay or spec.records_routing,
        "algo.routing_replay",
        f"needs an engine that records the experts each token was routed to "
        f"(rollout.engine={engines_with('records_routing')}); rollout.engine={r.engine} does not.",
    )


def _check_agent(cfg: Config) -> None:
    """rollout.agent names a registered agent or a loadable pkg.module:Class (its tools: _check_names)."""
    r = cfg.rollout
    try:
        agent_class(r.agent)
    except TandemError as e:
        raise TandemError(f"Config 'rollout.agent': {e}") from None
    require(r.max_turns >= 1, "rollout.max_turns", f"must be >= 1 (calls per episode), got {r.max_turns}.")
    require(
        r.agent_timeout_s > 0, "rollout.agent_timeout_s", f"must be > 0 seconds, got {r.agent_timeout_s}."
    )
    require(
        r.tool_parser in TOOL_PARSERS,
        "rollout.tool_parser",
        f"is {r.tool_parser!r}; valid: {', '.join(TOOL_PARSERS.names())}.",
    )
    require(len(set(r.tools)) == len(r.tools), "rollout.tools", f"names a tool twice: {r.tools}.")
    require(
        r.agent == "single_turn" or r.length_tail_alpha == 0,
        "rollout.length_tail_alpha",
        f"needs rollout.agent=single_turn (it is {r.agent!r}): decoding past EOS turns stop strings "
        "off, so no tool call would ever end a turn.",
    )


def _check_sync(cfg: Config) -> None:
    s, run = cfg.sync, cfg.run
    require(s.produce_bucket_mb > 0, "sync.produce_bucket_mb", "must be > 0.")
    require(s.consume_bucket_mb > 0, "sync.consume_bucket_mb", "must be > 0.")
    require(s.timeout_s > 0, "sync.timeout_s", "must be > 0 seconds.")
    require(s.every >= 1, "sync.every", "must be >= 1 (train steps between weight pushes).")
    require(
        s.every == 1 or (run.mode == "async" and run.max_staleness >= s.every - 1),
        "sync.every",
        f"is {s.every}: pushing every N steps needs run.mode=async with run.max_staleness >= N - 1 "
        f"(got mode {run.mode!r}, max_staleness {run.max_staleness}), or the buffer could not "
        "admit the groups the steps between two pushes train on.",
    )


def _check_placement(cfg: Config) -> None:
    """The resources roles are placed on."""
    p = cfg.placement
    require(cfg.ray.num_cpus >= 0, "ray.num_cpus", "must be >= 0 (0 = every core).")
    require(p.num_cpus >= 0, "placement.num_cpus", "must be >= 0 (0 = all the cluster has).")
    require(p.num_gpus >= 0, "placement.num_gpus", "must be >= 0 (0 = all the cluster has).")
    require(
        not p.num_gpus or cfg.run.device != "cpu",
        "placement.num_gpus",
        f"is {p.num_gpus:g}, but run.device=cpu puts nothing on a GPU: set run.device=cuda (or auto), "
        "or placement.num_gpus=0.",
    )


def _check_task_groups(cfg: Config) -> None:
    """placement.groups names each task once, places the two every run has, and has one ratio each."""
    p = cfg.placement
    if not p.groups:
        require(not p.ratios, "placement.ratios", "needs placement.groups (one ratio per task group).")
        return
    groups = [[g] if isinstance(g, str) else g for g in p.groups]
    tasks = [t for g in groups for t in g]
    for t in tasks:
        one_of(t, placement_tasks(), "placement.groups", "task")
    require(len(tasks) == len(set(tasks)), "placement.groups", f"names a task twice: {p.groups}.")
    for needed in (r.task for r in table() if r.task and not r.placed_with):
        require(needed in tasks, "placement.groups", f"must place '{needed}'; got {p.groups}.")
    require(
        all("actor_train" in g for g in groups if "logp" in g),
        "placement.groups",
        "must put 'logp' in the same group as 'actor_train': the train workers recompute the "
        "old logprobs on their own weights.",
    )
    require(
        len(p.ratios) == len(p.groups),
        "placement.ratios",
        f"needs one ratio per task group: {len(p.groups)} groups, {len(p.ratios)} ratios.",
    )
    require(all(r > 0 for r in p.ratios), "placement.ratios", f"must all be > 0, got {p.ratios}.")
    require(abs(sum(p.ratios) - 1) < 1e-6, "placement.ratios", f"must add up to 1, got {sum(p.ratios)}.")


def _check_sim(cfg: Config) -> None:
    """`tandem simulate`'s section (docs/simulate.md); its calibration file is checked when read."""
    s = cfg.sim
    require(all(g >= 1 for g in s.gpus), "sim.gpus", f"must be GPU counts >= 1 ([] = CPUs), got {s.gpus}.")
    for i, run in enumerate(s.runs):
        require(
            len(run) >= 1 and "=" not in run[0],
            f"sim.runs[{i}]",
            f"must be [label, section.key=value, ...], got {run}.",
        )
    labels = [run[0] for run in s.runs] or ["sync", "one_step_off", "async"]
    require(len(set(labels)) == len(labels), "sim.runs", f"has a label twice: {labels}.")
    one_of(s.baseline, labels, "sim.baseline", "run label")
    require(s.tensor_parallel >= 1, "sim.tensor_parallel", "must be >= 1 (GPUs per engine).")
    require(s.generate_calls >= 1, "sim.generate_calls", "must be >= 1.")
    require(0 < s.kv_memory_fraction <= 1, "sim.kv_memory_fraction", "must be in (0, 1].")
    require(s.prompt_tokens >= 1, "sim.prompt_tokens", "must be >= 1.")
    require(s.warmup_steps >= 0, "sim.warmup_steps", "must be >= 0.")
    require(
        bool(s.search_ratios) and all(0 < r < 1 for r in s.search_ratios),
        "sim.search_ratios",
        f"must be rollout shares in (0, 1), got {s.search_ratios}.",
    )
    require(
        bool(s.search_staleness) and all(k >= 0 for k in s.search_staleness),
        "sim.search_staleness",
        f"must be max_staleness values >= 0, got {s.search_staleness}.",
    )


def _check_sim_lengths(cfg: Config) -> None:
    """The simulated response lengths' distribution."""
    s = cfg.sim
    require(
        s.lengths in ("lognormal", "pareto") or s.lengths.startswith(("metrics:", "file:")),
        "sim.lengths",
        f"is {s.lengths!r}; valid: lognormal, pareto, metrics:PATH (a run's metrics.jsonl), "
        "file:PATH (measured response lengths).",
    )
    require(s.length_mean > 0, "sim.length_mean", "must be > 0 tokens.")
    require(s.length_sigma > 0, "sim.length_sigma", "must be > 0.")
    require(s.length_alpha > 1, "sim.length_alpha", "must be > 1 (a Pareto with a finite mean).")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    require(d.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1.")
    if not d.train_files:  # the synthetic task's rows
        _check_task(d.task, d.task_config)
        require(d.train_size >= 1, "data.train_size", f"must be >= 1, got {d.train_size}.")
    else:
        require(
            not d.task_config,
            "data.task_config",
            "is set, but data.train_files are given, so no synthetic task runs. Drop one of them.",
        )
    require(d.val_size >= 0, "data.val_size", f"must be >= 0, got {d.val_size}.")


def _check_task(task: str, task_config: dict) -> None:
    """The task's name, and its arguments by building it (a reasoning-gym dataset: imports it, and
    its config checked by reasoning-gym's own config class)."""
    if not task.startswith(REASONING_GYM):
        one_of(task, [*TASKS.names(), f"{REASONING_GYM}<dataset>"], "data.task", TASKS.kind)
    build_task(task, task_config)


def _check_reward(cfg: Config) -> None:
    w = cfg.reward
    require(w.num_workers >= 1, "reward.num_workers", "must be >= 1.")
    require(w.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds.")
    require(w.import_timeout_s > 0, "reward.import_timeout_s", "must be > 0 seconds.")
    require(w.max_abs > 0, "reward.max_abs", "must be > 0 (the largest |reward| trained on).")
    require(
        0 <= w.overlong_buffer < cfg.rollout.max_new_tokens,
        "reward.overlong_buffer",
        f"must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}) (0 = off), got "
        f"{w.overlong_buffer}.",
    )
    require(w.overlong_penalty >= 0, "reward.overlong_penalty", "must be >= 0.")
    require(w.sandbox_timeout_s > 0, "reward.sandbox_timeout_s", "must be > 0 seconds.")
    require(
        w.sandbox_memory_mb >= 32,
        "reward.sandbox_memory_mb",
        f"must be >= 32 (MiB of address space per test), got {w.sandbox_memory_mb}.",
    )


def _check_judge(cfg: Config) -> None:
    """reward.fn=judge needs a judge (a model, a template, a parser); a judge without it is refused,
    not ignored."""
    w, j = cfg.reward, cfg.reward.judge
    if w.fn != "judge":
        require(
            not j.path,
            "reward.judge.path",
            f"is {j.path!r}, but reward.fn={w.fn!r} never asks a judge: set reward.fn=judge to score "
            "with it, or leave reward.judge.path empty.",
        )
        return
    require(
        bool(j.path),
        "reward.judge.path",
        "must name the judge model with reward.fn=judge: its checkpoint directory or builtin:<name>.",
    )
    one_of(j.parser, JUDGE_PARSERS.names(), "reward.judge.parser", JUDGE_PARSERS.kind)
    why = template_error(j.template)
    require(not why, "reward.judge.template", f"{why} It is {j.template!r}.")
    require(j.max_new_tokens >= 1, "reward.judge.max_new_tokens", "must be >= 1.")
    require(j.timeout_s > 0, "reward.judge.timeout_s", "must be > 0 seconds.")
    require(
        j.verifier not in ("", "judge"),
        "reward.judge.verifier",
        f"is {j.verifier!r}: it must be a reward spec other than judge (e.g. auto), which scores the "
        "held-out samples, so that val/accuracy stays a verifier's accuracy.",
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
