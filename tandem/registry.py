"""Decorator registries: a dict of named functions and a getter whose error lists the valid names."""

from collections.abc import Callable
from typing import Generic, TypeVar

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
