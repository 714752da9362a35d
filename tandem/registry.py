"""Decorator registries: a dict of named entries, a getter whose error lists the valid names, and the
traits each entry declares, so the rest of tandem asks the registry what an entry needs instead of
comparing its name.

    ADV_ESTIMATORS = OptionRegistry("advantage estimator", traits=EstimatorTraits)

    @ADV_ESTIMATORS.register("gae", needs_critic=True)
    def gae_advantages(...): ...

    ADV_ESTIMATORS.traits("gae").needs_critic  # True; an entry that declares none gets the defaults

A registry's traits are one frozen dataclass whose fields all have defaults; a trait it does not
declare is an error at registration. An entry may also be a value rather than a function (an
engine's `EngineSpec`): then the value itself is what callers ask, and the registry has no traits.
"""

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, Generic, TypeVar, cast

from tandem.errors import TandemError

V = TypeVar("V")  # an entry: a function, or a value such as an engine's spec
F = TypeVar("F", bound=Callable)


class Registry(Generic[V]):
    """`@reg.register("name", **traits)` adds an entry; `reg.get("name")` returns it and
    `reg.traits("name")` its traits, or raise TandemError listing the valid names."""

    def __init__(self, kind: str, traits: type | None = None):
        self.kind = kind
        self._traits_type = traits
        self._items: dict[str, V] = {}
        self._traits: dict[str, Any] = {}

    def register(self, name: str, **traits: Any) -> Callable[[V], V]:
        declared = self._declare(name, traits)

        def add(value: V) -> V:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = value
            self._traits[name] = declared
            return value

        return add

    def _declare(self, name: str, traits: dict[str, Any]) -> Any:
        """The entry's traits: the registry's dataclass with the fields given, defaults for the rest."""
        if self._traits_type is None:
            if traits:
                raise ValueError(
                    f"{self.kind} {name!r} declares traits {sorted(traits)}; its registry has no traits"
                )
            return None
        valid = [f.name for f in fields(self._traits_type)]
        unknown = sorted(traits.keys() - set(valid))
        if unknown:
            raise ValueError(f"{self.kind} {name!r} declares {unknown}, not traits of its registry: {valid}")
        return self._traits_type(**traits)

    def get(self, name: str) -> V:
        if name not in self._items:
            raise TandemError(f"Unknown {self.kind} {name!r}. Valid names: {', '.join(self.names())}.")
        return self._items[name]

    def traits(self, name: str) -> Any:
        """The traits `name` registered with (the registry's traits dataclass); TandemError if unknown."""
        self.get(name)
        return self._traits[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def in_order(self) -> list[str]:
        """The names in the order they were registered."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


class OptionRegistry(Registry[F]):
    """A registry of functions whose keyword arguments are checked by name on every call via `get`.

    Two kinds of keyword argument reach an entry. `context` is what the framework hands every entry
    of the registry alike (the trainer's clip range, a mini-batch's token counts): an entry with no
    use for one leaves it out of its signature and the call drops it. Anything else is an option,
    and the entry must declare it. Entries take no `**kwargs`, so a misspelled option (`clip_hgh`)
    is an error naming the entry, the option and the valid ones, not a setting silently ignored.
    The decorator returns the plain function, so a direct call gets Python's own keyword check.
    """

    def __init__(self, kind: str, context: Iterable[str] = (), traits: type | None = None):
        super().__init__(kind, traits)
        self.context = frozenset(context)

    def register(self, name: str, **traits: Any) -> Callable[[F], F]:
        checked = super().register(name, **traits)

        def add(fn: F) -> F:
            checked(cast(F, _Checked(self.kind, name, fn, self.context)))
            return fn

        return add


class _Checked:
    """An entry as `OptionRegistry.get` returns it: drops the context keywords the function does not
    declare and refuses every other undeclared keyword. The signature is read once, here."""

    def __init__(self, kind: str, name: str, fn: Callable, context: frozenset[str]):
        params = inspect.signature(fn).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            raise ValueError(f"{kind} {name!r} takes **kwargs: declare its options so misspelled ones fail")
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.kind, self.name, self.fn = kind, name, fn
        self.options = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        self.unused = context - named  # context this entry has no use for
        self.allowed = named | context
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        unknown = sorted(kwargs.keys() - self.allowed)
        if unknown:
            raise TandemError(
                f"{self.kind.capitalize()} {self.name!r} has no option {unknown[0]!r}. Its options: "
                f"{', '.join(self.options) or 'none'}"
                + (
                    f" (it also accepts and ignores {', '.join(sorted(self.unused))})."
                    if self.unused
                    else "."
                )
            )
        if self.unused:
            kwargs = {k: v for k, v in kwargs.items() if k not in self.unused}
        return self.fn(*args, **kwargs)
