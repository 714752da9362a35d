"""How every command starts: `tandem train`, `serve`, `eval`, `generate` and `sft` take one path.

    load_config     read and typed (`tandem.config`), the loss's defaults, every value checked
                    (`tandem.runtime.checks`): bad input fails here, before anything is built
    resolve_inputs  paths made absolute; each model path (model.path, model.tokenizer, the teacher,
                    the judge, the critic) resolved ONCE to a directory: a "builtin:" name converted,
                    a hub id fetched into (or read from) huggingface_hub's cache. Everything after
                    this reads the directory; the run's config.yaml records it
    place           one process or Ray (started here when the run needs it), then the device and the
                    dtypes for where it runs (`tandem.devices.resolve`)
    build_cluster   the roles table's workers (or a command's subclasses of them) on that cluster

`tandem train` checks its data and its resume point between `resolve_inputs` and `place`, so that
bad input fails before Ray starts; `eval`, `generate` and `sft` run in this process and stop at
`place`. On a cluster of several machines every resolved directory must be at the same path on
each (a shared file system), as a local model.path always had to be.
"""

import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.config.loader import read_config
from tandem.config.schema import Config

# The config keys that name a checkpoint: "" = unset (the key's default follows model.path).
MODEL_PATHS = ("model.path", "model.tokenizer", "algo.distill.teacher", "reward.judge.path", "critic.path")
SFT_PATHS = ("sft.init_from",)  # `tandem sft` trains none of the above


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the recipe's YAML, then `a.b=value` overrides (values parsed as YAML), every
    key, type and value checked; errors name the field."""
    from tandem.runtime.checks import validate  # here: importing this module loads no trainer

    cfg, tree = read_config(recipe, overrides)
    apply_loss_defaults(cfg, tree.get("algo"))
    validate(cfg)
    return cfg


def apply_loss_defaults(cfg: Config, algo_tree: Any) -> None:
    """The chosen policy loss's own defaults for algo keys (gspo: its clip range) where neither the
    recipe nor an override set them. The schema's are ppo_clip's; only the tree knows what was set.
    An unknown loss brings none: `validate` names the field."""
    from tandem.algo import POLICY_LOSSES

    if cfg.algo.policy_loss not in POLICY_LOSSES:
        return
    given = algo_tree if isinstance(algo_tree, dict) else {}
    for key, value in POLICY_LOSSES.traits(cfg.algo.policy_loss).defaults.items():
        if key not in given:
            setattr(cfg.algo, key, value)


def resolve_inputs(cfg: Config, check_tokenizer: bool = True, keys: tuple[str, ...] = MODEL_PATHS) -> Config:
    """`cfg` with every path absolute (actors may run in another directory, or on another node) and
    each model path a directory; the reward function's spec canonical. A "builtin:" name or hub id
    resolves here, once, or fails with its one paragraph; a local path that does not exist is left
    for the check that owns it (which says what makes one: a teacher's recipe, a judge's).
    `check_tokenizer`: refuse a tokenizer without EOS or wider than the model's vocabulary now
    (`tandem eval` and `generate` check after unpacking a run's checkpoint instead). `keys`: the
    model paths the command reads."""
    from tandem.model.config import resolve_model_path
    from tandem.reward.user_fn import canonical_spec

    def absolute(path: str) -> str:
        return str(Path(path).resolve()) if path else path

    for key in keys:
        section, name = key.rsplit(".", 1)
        owner = _section(cfg, section)
        if spec := getattr(owner, name):
            cfg = _with(cfg, section, replace(owner, **{name: absolute(str(resolve_model_path(spec, key)))}))
    cfg = replace(
        cfg,
        reward=replace(cfg.reward, fn=canonical_spec(cfg.reward.fn)),
        run=replace(cfg.run, out_dir=absolute(cfg.run.out_dir)),
        sft=replace(cfg.sft, out=absolute(cfg.sft.out)),
    )
    if check_tokenizer:
        from tandem.runtime.roles import load_checked_tokenizer

        load_checked_tokenizer(cfg)
    return cfg


def _section(cfg: Config, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _with(cfg: Config, dotted: str, value: Any) -> Config:
    """`cfg` with the (nested) section `dotted` replaced by `value`."""
    head, _, rest = dotted.partition(".")
    return replace(cfg, **{head: _with(getattr(cfg, head), rest, value) if rest else value})


def in_one_process(cfg: Config, join_running_ray: bool = True) -> bool:
    """run.cluster: local, or auto where the run can be held in one process (`one_process_refusal`)
    and, with `join_running_ray`, Ray is not running here already (a caller that started or joined
    Ray meant it for the run; `tandem serve`, whose test sessions run Ray beside it, does not ask)."""
    from tandem.runtime.checks import one_process_refusal

    if cfg.run.cluster != "auto":
        return cfg.run.cluster == "local"
    ray = sys.modules.get("ray")  # not imported: not running either
    running = join_running_ray and ray is not None and ray.is_initialized()
    return not running and not one_process_refusal(cfg)


def place(cfg: Config, stack: ExitStack, join_running_ray: bool = True) -> tuple[Config, bool]:
    """Where the run computes -> (`cfg` with run.device and the dtypes concrete for it, whether it
    runs in this process). A Ray started here is shut down when `stack` closes."""
    from tandem import devices

    if in_one_process(cfg, join_running_ray):
        return here(cfg), True
    import ray  # only here: a run in one process never imports Ray

    from tandem.runtime.cluster import start_ray

    if start_ray(cfg):
        stack.callback(ray.shutdown)
    return devices.resolve(cfg, ray.cluster_resources().get("GPU", 0), "the Ray cluster"), False


def here(cfg: Config) -> Config:
    """`cfg` with run.device and the dtypes concrete for this machine: where `tandem eval`,
    `generate` and `sft` compute, and a run in one process."""
    import torch

    from tandem import devices

    return devices.resolve(cfg, torch.cuda.device_count(), "this machine")


def build_cluster(cfg: Config, local: bool, classes: dict[str, type] | None = None, only=None):
    """The run's workers, one per row of the roles table the run has, in this process
    (`LocalCluster`) or as Ray actors (`RayCluster`). `classes`: role -> a subclass of its row's
    worker to build instead (`tandem serve`'s). `only`: the roles to build (in this process)."""
    if local:
        from tandem.runtime.local import LocalCluster

        return LocalCluster.start(cfg, classes, only)
    from tandem.runtime.cluster import RayCluster

    return RayCluster.start(cfg, classes)
