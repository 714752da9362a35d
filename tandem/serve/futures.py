"""A request's future, as `retrieve_future` reports it: its result, or the `Failure` that ended it.

Whatever a request's work raises becomes its Failure, never the service's end: a TandemError is the
client's fault (category "user"), anything else the service's ("server"); errors outside
`Exception` count too (torch's CheckpointException is one). Cancelling and stopping still stop.
"""

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.errors import TandemError


class NotFound(TandemError):
    """A model, sampler, checkpoint or request that does not exist (HTTP 404)."""


@dataclasses.dataclass
class Failure:
    """A request's error, as `retrieve_future` reports it: "user" for a bad request, else "server"."""

    message: str
    category: str = "user"


def failure_of(e: BaseException) -> Failure:
    try:
        text = str(e)
    except Exception:  # an error whose message fails (one built wrongly) still ends its request
        text = "(its message cannot be read)"
    if isinstance(e, TandemError):
        return Failure(text, "user")
    return Failure(f"{type(e).__name__}: {text}", "server")


def fail(fut: asyncio.Future, failure: Failure) -> None:
    if not fut.done():
        fut.set_result(failure)


async def nothing(model: object) -> None:
    """A refused request's place in its model's order."""


async def settle(fut: asyncio.Future, work: Callable[[], Awaitable[Any]]) -> None:
    """Run `work` into `fut`: its result, or its error as a `Failure` (the service stays up). Errors
    outside `Exception` count too (torch's CheckpointException is one); cancelling and stopping
    still stop."""
    try:
        result = await work()
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        result = failure_of(e)
    if not fut.done():
        fut.set_result(result)
