"""Config: recipes, dotted overrides, and a clear error for every kind of mistake."""

import typing
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from tandem.config import Config, save_config
from tandem.config.verl import VERL_KEYS
from tandem.errors import TandemError
from tandem.runtime.startup import load_config
from tandem.train.optim import lr_factor

ROOT = Path(__file__).resolve().parent.parent


def test_default_recipe_equals_the_built_in_defaults():
    cfg = load_config(ROOT / "recipes" / "default.yaml")
    assert asdict(cfg) == asdict(Config())


# sim-calibration-*.yaml are `tandem simulate`'s hardware figures, not configs (tests/test_simulate.py).
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("sim-calibration"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    load_config(recipe)


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        None,
        [
            "rollout.n=4",
            "train.lr=1e-3",
            "algo.clip_c=3",
            "data.train_files=[a.jsonl]",
            "run.tensorboard=true",
            "algo.clip_c=null",
        ],
    )
    assert cfg.rollout.n == 4 and cfg.train.lr == 1e-3 and cfg.algo.clip_c is None
    assert cfg.data.train_files == ["a.jsonl"] and cfg.run.tensorboard is True


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["rollout.n=3", "algo.adv_estimator=rloo"])
    save_config(cfg, tmp_path / "c.yaml")
    assert asdict(load_config(tmp_path / "c.yaml")) == asdict(cfg)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.nn=4"], r"Unknown config key 'rollout.nn'.*Did you mean 'rollout.n'"),
        (["rolout.n=4"], r"Unknown config key 'rolout'.*Valid keys: run, model"),
        (["rollout.n=four"], r"'rollout.n' must be an integer, got 'four' \(str\)"),
        (["train.lr=[1]"], r"'train.lr' must be a number"),
        (["run.progress=3"], r"'run.progress' must be true or false"),
        (["algo.adv_estimator=ppg"], r"not a known advantage estimator.*grpo.*rloo"),
        (["algo.loss_agg=mean"], r"loss aggregation.*token-mean"),
        (["algo.kl_estimator=k9"], r"KL estimator.*k3"),
        (["data.task=divide"], r"not a known task.*addition.*countdown.*multiply.*reverse"),
        (["rollout.top_p=0"], r"'rollout.top_p' must be in \(0, 1\]"),
        (['rollout.stop=[""]'], r"'rollout' sampling settings: stop=\[''\] must be a list of non-empty"),
        (["rollout"], r"not of the form section.key=value"),
        (["rollout.engine=vllm", "rollout.temperature=0.7", "rollout.top_p=0.9"], r"vLLM cannot record"),
        (["rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0"], r"must be in \(0, 1\]"),
        (["rollout.engine=sglang"], r"not a known engine. Valid names: builtin, paged, vllm"),
        (["model.dtype=bfloat16"], r"'model.dtype' is gone: use train.dtype .* and rollout.dtype"),
        (["train.dtype=float16"], r"'train.dtype' is 'float16'.*loss scaling.*float32, bfloat16"),
        (["train.strategy=fsdp"], r"not a known training strategy. Valid names: ddp, fsdp2"),
        (["train.offload=optimizer"], r"FSDP2's CPU offload: set train.strategy=fsdp2"),
        (["run.device=gpu"], r"'run.device' is 'gpu'.*auto, cpu, cuda"),
        (["reward.sandbox_timeout_s=0"], r"'reward.sandbox_timeout_s' must be > 0 seconds"),
        (["reward.sandbox_memory_mb=16"], r"'reward.sandbox_memory_mb' must be >= 32 \(MiB.*got 16"),
    ],
)
def test_bad_config_gives_a_clear_error(overrides, expected):
    with pytest.raises(TandemError, match=expected):
        load_config(None, overrides)


def test_bad_recipe_files(tmp_path):
    with pytest.raises(TandemError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"rollout": {"temperature": "hot"}}))
    with pytest.raises(TandemError, match="'rollout.temperature' must be a number"):
        load_config(tmp_path / "bad.yaml")


# --- keys written as for verl -----------------------------------------------------------------------


def _tandem_keys(node: object = None, prefix: str = "") -> set[str]:
    """Every dotted key of the config tree, in nested sections too (train.lora.rank)."""
    node = Config() if node is None else node
    keys: set[str] = set()
    for f in fields(node):
        value = getattr(node, f.name)
        keys |= _tandem_keys(value, f"{prefix}{f.name}.") if is_dataclass(value) else {prefix + f.name}
    return keys


# Keys the resume work of issue 12 adds to run; the table maps verl's resume keys to them already.
COMING = {"run.resume", "run.keep_checkpoints"}


def test_the_verl_table_maps_to_tandem_keys_and_shadows_none():
    ours = _tandem_keys()
    assert len(VERL_KEYS) >= 25
    assert not set(VERL_KEYS) & ours
    assert {t for t, _ in VERL_KEYS.values() if t} - ours <= COMING


@pytest.mark.parametrize("key", sorted(VERL_KEYS))
def test_a_verl_key_names_tandems_equivalent(key):
    target, _ = VERL_KEYS[key]
    expected = f"tandem's equivalent is '{target}'" if target else "tandem has no equivalent: "
    with pytest.raises(TandemError, match=rf"Config '{key}' is verl's.*{expected}"):
        load_config(None, [f"{key}=1"])


def test_verl_keys_in_a_recipe_and_under_verl_sections(tmp_path):
    (tmp_path / "verl.yaml").write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n")
    with pytest.raises(TandemError, match="'actor_rollout_ref.actor.optim.lr' is verl's.*'train.lr'"):
        load_config(tmp_path / "verl.yaml")
    with pytest.raises(TandemError, match=r"'critic.model.path' is verl's.*'critic.path'"):
        load_config(None, ["critic.model.path=x"])
    with pytest.raises(TandemError, match=r"'reward_model.enable' is a verl key.*reward.fn"):
        load_config(None, ["reward_model.enable=true"])
    with pytest.raises(
        TandemError, match=r"'\+trainer.val_before_train' is verl's; tandem has no equivalent"
    ):
        load_config(None, ["+trainer.val_before_train=false"])


def test_docs_show_the_verl_table():
    docs = (ROOT / "docs" / "config.md").read_text()
    section = docs[docs.index("## Coming from verl") :]
    for key, (target, _) in VERL_KEYS.items():
        assert f"| `{key}` | {f'`{target}`' if target else '—'} |" in section, key


# --- closed sets and registry names ---------------------------------------------------------------


def _closed_sets() -> list[tuple[str, tuple[str, ...]]]:
    """Every schema field typed as a closed set (`Literal`), with its values."""
    out = []
    for section in fields(Config):
        for f in fields(section.type):
            hint = typing.get_type_hints(section.type)[f.name]
            if typing.get_origin(hint) is typing.Literal:
                out.append((f"{section.name}.{f.name}", typing.get_args(hint)))
    return out


def test_the_schema_has_closed_sets():
    assert {"run.mode", "train.strategy", "rollout.quantization", "sft.model_type"} <= dict(
        _closed_sets()
    ).keys()


@pytest.mark.parametrize("key, valid", _closed_sets(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_closed_set_refuses_other_values_at_load_naming_the_field_and_the_valid_ones(key, valid):
    load_config(None, [f"{key}={valid[0]}"])
    with pytest.raises(
        TandemError, match=rf"'{key}' is 'nope', not a known .*Valid names: {', '.join(valid)}\."
    ):
        load_config(None, [f"{key}=nope"])


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "run.mode=asynk",
            r"'run.mode' is 'asynk', not a known mode. Valid names: sync, one_step_off, async. "
            r"Did you mean 'async'\?",
        ),
        (
            "train.strategy=fsdp",
            r"not a known training strategy. Valid names: ddp, fsdp2. Did you mean 'fsdp2'\?",
        ),
        ("rollout.fp8_scale=ue8m", r"'rollout.fp8_scale' is 'ue8m'.*Did you mean 'ue8m0'\?"),
        # names a registry owns get the same hint
        (
            "algo.policy_loss=gpso",
            r"'algo.policy_loss' is 'gpso', not a known policy loss.*Did you mean 'gspo'\?",
        ),
    ],
)
def test_a_typo_gets_a_did_you_mean(override, expected):
    with pytest.raises(TandemError, match=expected):
        load_config(None, [override])


def test_an_unknown_lr_schedule_is_an_error_not_cosine():
    with pytest.raises(
        TandemError,
        match=r"'train.schedule' is 'cosin', not a known LR schedule.*"
        r"constant, cosine, linear.*Did you mean 'cosine'\?",
    ):
        load_config(None, ["train.schedule=cosin"])
    with pytest.raises(
        TandemError, match=r"Unknown LR schedule 'cosin'. Valid names: constant, cosine, linear"
    ):
        lr_factor(5, 0, 10, "cosin", 0.0)
    assert lr_factor(5, 0, 10, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(5, 0, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(5, 0, 10, "constant", 0.0) == 1.0
