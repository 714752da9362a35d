"""The config a command starts from: read and typed by `tandem.config`, then given the defaults and
the checks that need the modules the values name (losses, engines, tasks, judges), which
`tandem.config` does not import."""

from pathlib import Path
from typing import Any

from tandem.config.loader import read_config
from tandem.config.schema import Config


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
