"""The HTTP side of the OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, on 127.0.0.1, as a FastAPI app served by uvicorn.

uvicorn serves it on `EndpointServer.loop`, an asyncio loop in a thread of its own, and the agents'
episodes run on that same loop (`openai_agent.py`): a request and its answer stay on the loop's
thread, and no thread is started or blocked per connection or per request.

It knows nothing of engines: it checks a request's JSON (`openai_request.py`), awaits
`backend(request)` (the agent's dispatcher, which resolves once the engine has served the request,
batched with the other episodes') and writes the answer as OpenAI does, built from `openai.types`,
streamed (server-sent events) or not. Each choice also carries the engine's `token_ids` (vLLM's
extension; the types keep fields they do not declare).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
    chat_completion,
    chat_completion_chunk,
)
from openai.types.completion_choice import Logprobs
from openai.types.shared import ErrorObject
from starlette.exceptions import HTTPException

from tandem.agent.openai_request import EPISODE_HEADER, BadRequest, Choice, Request, check_request

log = logging.getLogger(__name__)

Backend = Callable[[Request], Awaitable[tuple[list[Choice], int]]]


def answer_of(
    r: Request, model: str, choices: list[Choice], prompt_tokens: int
) -> ChatCompletion | Completion:
    """The non-streamed answer: a chat completion or a (text) completion."""
    created, tokens = int(time.time()), sum(len(c.token_ids) for c in choices)
    usage = CompletionUsage(
        prompt_tokens=prompt_tokens, completion_tokens=tokens, total_tokens=prompt_tokens + tokens
    )
    if r.chat:
        return ChatCompletion(
            id="chatcmpl-" + uuid.uuid4().hex,
            object="chat.completion",
            created=created,
            model=model,
            choices=[
                chat_completion.Choice(
                    index=i,
                    message=_message(c),
                    logprobs=_chat_logprobs(c) if r.logprobs else None,
                    finish_reason=c.finish_reason,
                    token_ids=c.token_ids,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage,
        )
    return Completion(
        id="cmpl-" + uuid.uuid4().hex,
        object="text_completion",
        created=created,
        model=model,
        choices=[
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=_completion_logprobs(c) if r.logprobs else None,
                finish_reason=c.finish_reason,
                token_ids=c.token_ids,
            )
            for i, c in enumerate(choices)
        ],
        usage=usage,
    )


def _message(c: Choice) -> ChatCompletionMessage:
    if c.tool_calls:
        return ChatCompletionMessage(role="assistant", content=c.content, tool_calls=c.tool_calls)
    return ChatCompletionMessage(role="assistant", content=c.content)


def _chat_logprobs(c: Choice) -> chat_completion.ChoiceLogprobs:
    return chat_completion.ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[])
            for t, lp in zip(c.tokens, c.logprobs, strict=True)
        ]
    )


def _completion_logprobs(c: Choice) -> Logprobs:
    return Logprobs(tokens=c.tokens, token_logprobs=c.logprobs, top_logprobs=None, text_offset=None)


def stream_events(answer: ChatCompletion | Completion) -> list[ChatCompletionChunk | Completion]:
    """A finished answer as the chunks a streamed one is made of (one content chunk per choice),
    then one with the usage."""
    head = {"id": answer.id, "created": answer.created, "model": answer.model}
    if isinstance(answer, Completion):  # a streamed completion is made of completions
        events = [
            Completion(
                **head,
                object="text_completion",
                choices=[  # as before: no token ids in a stream
                    CompletionChoice(
                        index=c.index, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason
                    )
                ],
            )
            for c in answer.choices
        ]
        return [*events, Completion(**head, object="text_completion", choices=[], usage=answer.usage)]
    Delta, Chunk = chat_completion_chunk.ChoiceDelta, chat_completion_chunk.Choice
    chunks = []
    for c in answer.choices:
        m, i = c.message, c.index
        delta = {}
        if m.content:
            delta["content"] = m.content
        if m.tool_calls:
            delta["tool_calls"] = [{"index": k, **t.model_dump()} for k, t in enumerate(m.tool_calls)]
        logprobs = None
        if c.logprobs is not None:
            logprobs = chat_completion_chunk.ChoiceLogprobs(content=c.logprobs.content)
        chunks += [
            Chunk(index=i, delta=Delta(role="assistant", content=""), finish_reason=None),
            Chunk(index=i, delta=Delta(**delta), logprobs=logprobs, finish_reason=None),
            Chunk(index=i, delta=Delta(), finish_reason=c.finish_reason),
        ]
    events = [ChatCompletionChunk(**head, object="chat.completion.chunk", choices=[c]) for c in chunks]
    return [
        *events,
        ChatCompletionChunk(**head, object="chat.completion.chunk", choices=[], usage=answer.usage),
    ]


def build_app(endpoint: EndpointServer) -> FastAPI:
    """The routes, each answering in OpenAI's shapes; errors as OpenAI's error body."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/v1/models")
    async def models() -> Response:
        model = Model(id=endpoint.model, object="model", created=0, owned_by="tandem")
        return _json(200, {"object": "list", "data": [model.model_dump()]})

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(http: HTTPRequest) -> Response:
        episode = http.headers.get(EPISODE_HEADER)
        try:
            try:
                body = json.loads(await http.body() or b"null")
            except ValueError as e:  # not JSON, or not UTF-8
                raise BadRequest(f"the body is not JSON: {e}") from None
            request = check_request(http.url.path, body, episode)
            choices, prompt_tokens = await endpoint.backend(request)
        except BadRequest as e:
            endpoint.refused(episode, e)
            return _error(e.status, str(e), e.param)
        except Exception as e:  # a bug: answered here, so the agent's connection stays open
            log.exception("the OpenAI-compatible endpoint failed on a request")
            return _error(500, f"the endpoint failed: {type(e).__name__}: {e}", kind="server_error")
        answer = answer_of(request, endpoint.model, choices, prompt_tokens)
        if not request.stream:
            return Response(answer.model_dump_json(exclude_unset=True), media_type="application/json")
        events = "".join(f"data: {e.model_dump_json(exclude_unset=True)}\n\n" for e in stream_events(answer))
        return Response(events + "data: [DONE]\n\n", media_type="text/event-stream")

    @app.exception_handler(HTTPException)
    async def no_route(http: HTTPRequest, e: HTTPException) -> Response:  # FastAPI's 404 and 405
        return _error(e.status_code, f"{http.method} {http.url.path}: {e.detail}", kind="not_found")

    return app


def _json(status: int, obj: dict) -> Response:
    return Response(json.dumps(obj), status, media_type="application/json")


def _error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> Response:
    return _json(
        status, {"error": ErrorObject(message=message, type=kind, param=param, code=None).model_dump()}
    )


class EndpointServer:
    """`backend(request)` -> awaitable (choices, prompt_tokens) behind an OpenAI-compatible HTTP API,
    on a port of 127.0.0.1 the OS picks (`base_url`). uvicorn serves it on `loop`, which runs in a
    thread of its own (uvloop's loop when uvloop is installed, as uvicorn picks): the caller runs its
    own coroutines there too (the agents' episodes). `backend` raises BadRequest to refuse a
    request, and `refused(episode id or None, error)` hears of every refusal (the checks here and
    the backend's)."""

    def __init__(
        self,
        backend: Backend,
        model: str = "tandem",
        refused: Callable[[str | None, BadRequest], None] = lambda episode, error: None,
    ):
        self.backend, self.model, self.refused = backend, model, refused
        config = uvicorn.Config(
            build_app(self),
            lifespan="off",
            ws="none",
            log_config=None,  # the run's logging stays as it is; no line per request
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,  # close() does not wait on a request the engine never served
        )
        self.loop = config.get_loop_factory()()
        # Bound and listening before the loop serves it: a request sent at once waits in the backlog.
        sock = socket.create_server(("127.0.0.1", 0), backlog=config.backlog)
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._uvicorn = uvicorn.Server(config)
        threading.Thread(target=self.loop.run_forever, name="openai-endpoint", daemon=True).start()
        self._serving = asyncio.run_coroutine_threadsafe(self._uvicorn.serve([sock]), self.loop)

    def close(self) -> None:
        """Stop serving, then stop the loop (and whatever else still runs on it)."""
        self._uvicorn.should_exit = True  # uvicorn looks every 0.1 s
        self._serving.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
