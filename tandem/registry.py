"""Decorator registries: a dict of named functions and a getter whose error lists the valid names."""

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

from tandem.errors import TandemError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """`@reg.register("name")` adds a function; `reg.get("name")` returns it or raises TandemError."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        if name not in self._items:
            raise TandemError(f"Unknown {self.kind} {name!r}. Valid names: {', '.join(self.names())}.")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

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

    def __init__(self, kind: str, context: Iterable[str] = ()):
        super().__init__(kind)
        self.context = frozenset(context)

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            super(OptionRegistry, self).register(name)(cast(F, _Checked(self.kind, name, fn, self.context)))
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
