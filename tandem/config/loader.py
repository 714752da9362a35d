"""Read a recipe, apply dotted overrides, check every key, type and closed set (a `Literal` of the
schema); errors name the field. Nothing here reaches above `tandem.config`: the values are checked
against the modules that own them at start-up (`tandem.runtime.startup.load_config`,
`tandem.runtime.checks`)."""

import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from tandem.config.schema import Config
from tandem.config.verl import verl_key_error
from tandem.errors import TandemError

TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
LIST_EXAMPLES = {int: "1, 2", float: "0.9, 0.999", str: "a.jsonl, b.jsonl"}
# Keys that existed once, with what replaced them: an old recipe gets told, not just refused.
RENAMED = {
    "model.dtype": "train.dtype (the trainer's compute dtype; its weights stay fp32) and rollout.dtype "
    "(the engines')",
}


def read_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> tuple[Config, dict]:
    """Defaults, then the recipe's YAML, then `a.b=value` overrides (values parsed as YAML) -> the
    typed Config and the tree the recipe and overrides gave (what was set, for defaults that depend
    on it)."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        tree = _read_yaml(Path(recipe))
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise TandemError(f"Override {item!r} is not of the form section.key=value (e.g. rollout.n=8).")
        node = tree
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise TandemError(f"Override {item!r}: {part!r} is a value, not a section.")
        node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
    for key in _leaf_keys(tree):
        if message := verl_key_error(key):
            raise TandemError(message)
    return _build(Config, tree, ""), tree


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of the tree that holds a value, e.g. ["rollout.n", "algo.clip_low"]."""
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise TandemError(
            f"Recipe file {path} does not exist. Recipes live in recipes/ (e.g. recipes/default.yaml)."
        )
    try:
        tree = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except KeyTwice as e:
        raise TandemError(
            f"Recipe {path} sets {e.key!r} twice (lines {e.lines[0]} and {e.lines[1]}); YAML would keep the "
            "second one without a word. Keep one."
        ) from None
    except yaml.YAMLError as e:
        raise TandemError(f"Recipe {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TandemError(f"Recipe {path} cannot be read: {e}.") from None
    if tree is None:  # an empty file would train the defaults without a word; that needs no recipe
        raise TandemError(
            f"Recipe {path} is empty. Give it sections (run:, model:, rollout: ...), or leave the recipe "
            "out to run the defaults."
        )
    if not isinstance(tree, dict):
        raise TandemError(f"Recipe {path} must be a mapping of sections (run:, model:, rollout: ...).")
    return tree


class KeyTwice(Exception):
    """A mapping key written twice: its dotted path and the two lines (1-based)."""

    def __init__(self, key: str, lines: tuple[int, int]):
        super().__init__(key)
        self.key, self.lines = key, lines


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that raises KeyTwice for a mapping key written twice (plain YAML keeps the last)."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_keys(node, "", set())
        return self.construct_document(node)


def _check_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Walk the composed tree once (aliases too, once each), before anything is constructed."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_keys(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":  # `<<` overrides
                name, line = f"{path}.{key.value}" if path else key.value, key.start_mark.line + 1
                if key.value in lines:
                    raise KeyTwice(name, (lines[key.value], line))
                lines[key.value] = line
                _check_keys(value, name, seen)


def _build(cls: type, tree: dict[str, Any], prefix: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    for key in tree:
        if key not in known and f"{prefix}{key}" in RENAMED:
            raise TandemError(f"Config '{prefix}{key}' is gone: use {RENAMED[prefix + key]}.")
        if key not in known:
            where = f" in section '{prefix[:-1]}'" if prefix else ""
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise TandemError(
                f"Unknown config key '{prefix}{key}'{where}.{hint} Valid keys: {', '.join(known)}."
            )
    hints = typing.get_type_hints(cls, include_extras=True)  # with each closed set's name
    values = {}
    for name, f in known.items():
        hint = hints[name]
        if is_dataclass(hint):
            sub = tree.get(name, {})
            if not isinstance(sub, dict):
                raise TandemError(
                    f"Config '{prefix}{name}' is a section; set its keys, e.g. {prefix}{name}.key=value."
                )
            values[name] = _build(hint, sub, f"{prefix}{name}.")
        elif name in tree:
            values[name] = _coerce(tree[name], hint, f"{prefix}{name}")
        elif f.default is MISSING:
            values[name] = f.default_factory()  # type: ignore[misc]
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a field's type; ints are accepted where floats are expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Annotated, typing.Literal):  # a closed set (schema.py)
        return _choice(value, hint, key)
    if origin in (typing.Union, types.UnionType):
        return _first_fit(value, args, key)
    if origin is dict:  # data.task_config: whatever mapping its owner takes, checked there
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _type_error(key, value, "a mapping of names to values, e.g. {max_digits: 3}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(key, value, f"a list, e.g. [{LIST_EXAMPLES.get(args[0], '...')}]")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML reads 1e-3 (no dot) as a string; it is plainly a number
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # names like run.name=1 stay usable
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise _type_error(key, value, TYPE_NAMES.get(hint, hint.__name__))
    return value


def _first_fit(value: Any, options: tuple[Any, ...], key: str) -> Any:
    """`value` as the first of a union's types it fits (e.g. list[str] | str); None where allowed.
    The error is the last type's."""
    if value is None and type(None) in options:
        return None
    options = tuple(o for o in options if o is not type(None))
    for option in options[:-1]:
        try:
            return _coerce(value, option, key)
        except TandemError:
            pass
    return _coerce(value, options[-1], key)


def _choice(value: Any, hint: Any, key: str) -> Any:
    """A closed set's value, or TandemError naming the valid ones and the closest. The set is a
    `Literal[...]`, or `Annotated[Literal[...], "its name"]` for the message."""
    what = "value"
    if typing.get_origin(hint) is typing.Annotated:
        hint, what = typing.get_args(hint)[:2]
    one_of(value, typing.get_args(hint), key, what)
    return value


def require(ok: bool, key: str, message: str) -> None:
    """TandemError "Config 'key' message" unless `ok`."""
    if not ok:
        raise TandemError(f"Config '{key}' {message}")


def one_of(value: object, valid: Sequence[str], key: str, what: str) -> None:
    """TandemError naming the field, the valid names and the closest one, unless `value` is valid."""
    if value in valid:
        return
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    names = ", ".join(valid)
    raise TandemError(f"Config '{key}' is {value!r}, not a known {what}. Valid names: {names}.{hint}")


def _type_error(key: str, value: Any, expected: str) -> TandemError:
    return TandemError(f"Config '{key}' must be {expected}, got {value!r} ({type(value).__name__}).")
