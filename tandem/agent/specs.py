"""The function an endpoint agent's spec names (`rollout.agent=<kind>:pkg.module:function`),
loaded by `tandem.loading`, with errors in the agent's words: each names the spec and the form
its kind expects."""

import inspect
from collections.abc import Callable
from typing import Any

from tandem.errors import TandemError
from tandem.loading import LoadError, load

OPENAI = "openai:"
OPENAI_FORM = "rollout.agent=openai:pkg.module:function, with `async def function(client, task)`"


def named_attr(spec: str, prefix: str, form: str, before_import: Callable[[], None] = lambda: None) -> Any:
    """ "<prefix>pkg.module:name" (or without the prefix) -> the module's attribute, None where it
    has none; TandemError naming `form` for a spec of another shape or a module that does not
    import. `before_import` runs once the shape is right (a check that the agent's package is
    installed)."""
    name = spec.removeprefix(prefix)
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise TandemError(f"Agent {spec!r}: expected {form}.")
    before_import()
    try:
        return load(name)
    except LoadError as e:
        if e.reason == "attribute":
            return None
        if e.reason == "shape":
            raise TandemError(f"Agent {spec!r}: expected {form}.") from None
        raise TandemError(f"Agent {spec!r}: cannot import module {module!r}: {e.error}.") from None


def load_agent_fn(spec: str) -> Callable:
    """ "openai:pkg.module:function" (or without the prefix) -> the coroutine function."""
    fn = named_attr(spec, OPENAI, OPENAI_FORM)
    if fn is None or not inspect.iscoroutinefunction(fn):
        module, _, attr = spec.removeprefix(OPENAI).partition(":")
        what = "has no attribute" if fn is None else "is not an `async def` function:"
        raise TandemError(f"Agent {spec!r}: module {module!r} {what} {attr!r}. Expected {OPENAI_FORM}.")
    return fn
