"""Idempotent requests: the first response to each `X-Idempotency-Key`, sent again to its retries.

The `tinker` SDK gives every POST a key (a uuid4) and sends a request again under the same key, for
up to five minutes, when the connection drops or the service answers 408, 409, 429 or 5xx. A retry
of a request the service did receive must not run it twice (a second forward_backward would add
its gradients twice) nor fail (its seq_id is used): it gets the first copy's response, the same
request id, so the client polls the one future. A retry that arrives while the first copy is still
being answered waits for that answer.

Reads that are safe to repeat (`retrieve_future`, heartbeats, telemetry) are answered afresh: a
retried poll must see the future's new state, not the old "try again". The last `KEPT` answers are
kept; the SDK stops retrying a request after minutes, well before a busy service answers that many.
"""

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from starlette.responses import Response

KEPT = 4096
FRESH = ("/retrieve_future", "/session_heartbeat", "/telemetry")  # path endings answered afresh
REPLAYED = "x-tandem-replayed"  # set on a response sent again: tests and logs tell the copies apart


class Replies:
    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self.answers: OrderedDict[str, asyncio.Future] = OrderedDict()

    def applies(self, method: str, path: str, key: str | None) -> bool:
        return bool(key) and method == "POST" and not path.endswith(FRESH)

    async def once(self, key: str, answer: Callable[[], Awaitable[Response]]) -> Response:
        """`answer()`'s response for the first request under `key`; the same status, headers and
        body for every later one (after the first's answer is ready)."""
        while (known := self.answers.get(key)) is not None:
            try:
                status, headers, body = await asyncio.shield(known)
            except asyncio.CancelledError:
                if not known.cancelled():  # this request itself was cancelled
                    raise
                continue  # the first copy ended unanswered: this one answers (below)
            return Response(body, status, headers={**headers, REPLAYED: "true"})
        first = asyncio.get_running_loop().create_future()
        self.answers[key] = first
        while len(self.answers) > self.kept and next(iter(self.answers.values())).done():
            self.answers.popitem(last=False)
        try:
            response = await answer()
            body = b"".join([chunk async for chunk in response.body_iterator])
        except BaseException:
            del self.answers[key]  # unanswered: a copy waiting, or a later retry, runs it
            first.cancel()
            raise
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        first.set_result((response.status_code, headers, body))
        return Response(body, response.status_code, headers=headers)
