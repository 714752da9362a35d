"""The checks of the algorithm, training, LoRA, SFT and deterministic sections (`tandem.runtime.checks`
runs them with the others), and `check_training`, what a run that trains needs of its task."""

import torch

from tandem.algo import ADV_ESTIMATORS, CORRECTIONS
from tandem.config.loader import require
from tandem.config.schema import LORA_ALL_LINEAR, Config
from tandem.errors import TandemError
from tandem.rollout.engines import ENGINES, engines_with


def check_algo(cfg: Config) -> None:
    a = cfg.algo
    if a.distill.teacher:
        require(a.distill.coef > 0, "algo.distill.coef", f"must be > 0, got {a.distill.coef}.")
        require(
            not ADV_ESTIMATORS.traits(a.adv_estimator).needs_critic,
            "algo.distill.teacher",
            f"cannot be used with algo.adv_estimator={a.adv_estimator}: its critic's advantages and "
            "the teacher's per-token ones are two answers to one question. Use grpo (or another "
            "group estimator), with algo.distill.task_reward=true to add the task's signal.",
        )
    require(0 <= a.clip_low < 1, "algo.clip_low", f"must be in [0, 1), got {a.clip_low}.")
    require(a.clip_high >= 0, "algo.clip_high", f"must be >= 0, got {a.clip_high}.")
    require(a.clip_c is None or a.clip_c > 1, "algo.clip_c", "must be > 1 (or null to disable).")
    require(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0 (0 = off), got {a.kl_coef}.")
    require(a.max_filter_rounds >= 1, "algo.max_filter_rounds", "must be >= 1.")
    require(
        not a.filter_groups or cfg.rollout.n >= 2,
        "algo.filter_groups",
        "needs rollout.n >= 2: a group of one always has equal rewards and would always be dropped.",
    )
    require(0 <= a.gamma <= 1, "algo.gamma", f"must be in [0, 1], got {a.gamma}.")
    require(0 <= a.lam <= 1, "algo.lam", f"must be in [0, 1], got {a.lam}.")


def check_correction_set(cfg: Config) -> None:
    """algo.corrections combine: no entry twice, and at most one weight by π_old/μ, which none may
    apply once bypass has made π_old the engine's μ (each entry's `CorrectionTraits`)."""
    names = cfg.algo.corrections
    require(len(set(names)) == len(names), "algo.corrections", f"names one twice: {names}.")
    weights = [n for n in names if CORRECTIONS.traits(n).weights]
    for bypass in [n for n in names if CORRECTIONS.traits(n).old_is_behaviour]:
        require(
            not weights,
            "algo.corrections",
            f"combines {bypass} with {', '.join(weights)}: {bypass} makes π_old the engine's logprob μ, "
            "so there is no π_old/μ (nor a π_prox/μ) left to weight by. Keep one.",
        )
    require(
        len(weights) <= 1,
        "algo.corrections",
        f"combines {', '.join(weights)}: each weights the loss by π_old/μ, so together they apply it "
        "twice. Keep one (one that only masks combines with any).",
    )


def check_corrections(cfg: Config) -> None:
    """The corrections' options."""
    a = cfg.algo
    require(
        a.correction_cap is None or a.correction_cap > 0,
        "algo.correction_cap",
        f"must be > 0 (or null for no cap), got {a.correction_cap}.",
    )
    require(
        0 <= a.mis_low <= 1 <= a.mis_high,
        "algo.mis_low",
        f"and algo.mis_high must satisfy 0 <= mis_low <= 1 <= mis_high so on-policy tokens (ratio 1) "
        f"are kept, got [{a.mis_low}, {a.mis_high}].",
    )
    require(a.opsm_delta >= 0, "algo.opsm_delta", f"must be >= 0, got {a.opsm_delta}.")
    proximal = [n for n in CORRECTIONS.names() if CORRECTIONS.traits(n).old_is_prox]
    require(
        a.prox_logprob == "recompute" or any(n in proximal for n in a.corrections),
        "algo.prox_logprob",
        f"is {a.prox_logprob!r}, which only a correction against a proximal policy uses: add "
        f"{' or '.join(proximal)} to algo.corrections.",
    )


def check_critic(cfg: Config) -> None:
    """The value model of an estimator that needs one (the rest of its training follows `train`)."""
    require(cfg.critic.lr > 0, "critic.lr", "must be > 0.")
    require(cfg.critic.vf_clip > 0, "critic.vf_clip", "must be > 0.")


def check_train(cfg: Config) -> None:
    t = cfg.train
    require(t.num_workers >= 1, "train.num_workers", "must be >= 1.")
    require(t.lr > 0, "train.lr", "must be > 0.")
    require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0.")
    require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}.")
    require(
        0 <= t.min_lr_ratio <= 1,
        "train.min_lr_ratio",
        f"must be in [0, 1] (of train.lr), got {t.min_lr_ratio}.",
    )
    require(len(t.betas) == 2, "train.betas", "must be two numbers, e.g. [0.9, 0.999].")
    require(t.epochs >= 1, "train.epochs", "must be >= 1.")
    require(t.mini_batch_size >= 0, "train.mini_batch_size", "must be >= 0 (0 = whole batch).")
    require(t.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1.")
    require(
        t.offload == "none" or t.strategy == "fsdp2",
        "train.offload",
        f"is {t.offload!r}, which is FSDP2's CPU offload: set train.strategy=fsdp2 as well.",
    )


def check_lora(cfg: Config) -> None:
    """train.lora's values, and what adapters cannot run with. Its targets are checked against the
    model's modules before any actor starts (`tandem.model.lora.check_lora`, in `build_data`)."""
    lora = cfg.train.lora
    require(
        lora.rank >= 0, "train.lora.rank", f"must be >= 0 (0 = off: every weight trains), got {lora.rank}."
    )
    require(
        lora.alpha > 0,
        "train.lora.alpha",
        f"must be > 0 (the update is scaled by alpha / rank), got {lora.alpha}.",
    )
    require(0 <= lora.dropout < 1, "train.lora.dropout", f"must be in [0, 1), got {lora.dropout}.")
    targets = lora.target_modules
    require(
        targets == LORA_ALL_LINEAR if isinstance(targets, str) else bool(targets) and all(targets),
        "train.lora.target_modules",
        f"is {targets!r}: give a list of module names, e.g. [q_proj, v_proj] (a module whose name is one "
        f"of them or ends in '.' + one gets an adapter, as in PEFT), or {LORA_ALL_LINEAR}. A single name "
        "is a list of one: [q_proj].",
    )
    require(
        all(lora.modules_to_save),
        "train.lora.modules_to_save",
        f"holds an empty name: {lora.modules_to_save}.",
    )
    if not lora.rank:
        return
    ENGINES.get(cfg.rollout.engine).check_lora(lora.rank, lora.modules_to_save, lora.target_modules)
    require(
        not cfg.run.deterministic or lora.dropout == 0,
        "train.lora.dropout",
        f"is {lora.dropout} with run.deterministic=true: the batch-invariant forward multiplies by each "
        "adapted weight merged with its adapter (as the engines do), which has no form that drops "
        "the adapter's inputs alone. Set train.lora.dropout=0.",
    )
    require(
        not lora.modules_to_save or cfg.algo.kl_coef == 0,
        "train.lora.modules_to_save",
        f"is {lora.modules_to_save} with algo.kl_coef={cfg.algo.kl_coef}: the KL term's reference is the "
        "policy with its adapters off, and a module trained whole has no original left to turn back "
        "to. Train adapters only (modules_to_save=[]) or drop the KL term.",
    )
    groups = [t for g in cfg.placement.groups for t in ([g] if isinstance(g, str) else g)]
    require(
        "ref_logp" not in groups,
        "placement.groups",
        "places ref_logp, but with train.lora.rank > 0 there is no reference worker: the reference "
        "policy is the train workers' own model with its adapters off. Leave ref_logp out.",
    )


def check_sft(cfg: Config) -> None:
    s = cfg.sft
    require(0 <= s.flawed_fraction <= 1, "sft.flawed_fraction", "must be in [0, 1].")
    # Against data.train_size only in run_sft: `tandem train` with a small data.train_size is fine.
    require(s.batch_size >= 1, "sft.batch_size", "must be >= 1.")
    require(
        s.hidden_size % s.num_attention_heads == 0,
        "sft.hidden_size",
        "must be divisible by sft.num_attention_heads.",
    )
    require(
        s.num_attention_heads % s.num_key_value_heads == 0,
        "sft.num_key_value_heads",
        "must divide sft.num_attention_heads.",
    )


def check_deterministic(cfg: Config) -> None:
    """The settings a bit-reproducible run cannot have, each refused with the reason."""
    require(
        cfg.run.mode != "async",
        "run.deterministic",
        "cannot be reproduced with run.mode=async: streaming trains on whichever groups finish first, "
        "and with rollout.on_update=continue or abort a weight update lands at whatever token the "
        "engine has reached; both depend on timing. Use run.mode=sync or one_step_off "
        "(generate_ahead_steps=k gives async's overlap on a fixed schedule).",
    )
    require(
        ENGINES.get(cfg.rollout.engine).batch_invariant,
        "run.deterministic",
        f"needs an engine with a batch-invariant forward (rollout.engine="
        f"{engines_with('batch_invariant')}): rollout.engine={cfg.rollout.engine}'s kernels are not "
        "batch-invariant, so its logprobs differ from the trainer's.",
    )
    require(
        not cfg.rollout.compile,
        "run.deterministic",
        "cannot use rollout.compile=true: Inductor's fused kernels round differently from the trainer's.",
    )
    require(
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
