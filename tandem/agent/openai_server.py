"""The HTTP side of the OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, on 127.0.0.1, with Python's own `ThreadingHTTPServer` (one thread per connection; the
agents of one worker are its only clients, so nothing more is needed).

It knows nothing of engines: it checks a request's JSON, hands it to `backend(request)` (the
agent's dispatcher, which blocks until the engine has served it) and writes the answer as OpenAI
does, streamed (server-sent events) or not. Every request names its episode in the
`X-Tandem-Episode` header: the client tandem gives each agent sets it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

EPISODE_HEADER = "X-Tandem-Episode"
ROLES = ("system", "developer", "user", "assistant", "tool")

# Accepted request fields. Sampling fields the run decides (see docs/agents.md) are accepted and
# ignored; the ones below that change what is generated in a way tandem cannot honour are refused
# unless they hold their neutral value.
_COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "logprobs",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "seed",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_logprobs",
    "metadata",
    "store",
}
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "echo": False,
    "best_of": 1,
    "suffix": None,
    "response_format": {"type": "text"},
}


class BadRequest(Exception):
    """A request the endpoint refuses: HTTP 400 with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Request:
    """One checked request. `chat`: messages (+ tools) else a plain `prompt`."""

    episode: str
    chat: bool
    body: dict[str, Any]
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    stream: bool = False


@dataclass
class Choice:
    """What the backend answers per choice: text, token ids and logprobs, tool calls."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]
    finish_reason: str  # stop | length | tool_calls
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


def check_request(path: str, body: Any, episode: str | None) -> Request:
    """The JSON body of a POST to `path` -> a Request; BadRequest naming the field otherwise."""
    if not episode:
        raise BadRequest(
            f"missing header {EPISODE_HEADER}: use the client tandem gives the agent (its requests carry "
            "their episode's id)."
        )
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    chat = path.endswith("/chat/completions")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key, value in body.items():
        if key not in allowed:
            raise BadRequest(f"unknown parameter {key!r}", key)
        if key in _NEUTRAL and value not in (_NEUTRAL[key], None):
            raise BadRequest(f"{key}={value!r} is not supported by tandem's endpoint", key)
    r = Request(episode=episode, chat=chat, body=body)
    if chat:
        _check_chat(r, body)
    else:
        _check_prompt(r, body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("max_tokens must be a positive integer", "max_tokens")
    r.max_tokens = max_tokens
    stop = body.get("stop") or []
    r.stop = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in r.stop):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", "stop")
    r.n = body.get("n") or 1
    if not isinstance(r.n, int) or r.n < 1:
        raise BadRequest("n must be a positive integer", "n")
    r.logprobs = bool(body.get("logprobs"))
    r.stream = bool(body.get("stream"))
    return r


def _check_chat(r: Request, body: dict) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"bad message {m!r}: each needs a role, one of {', '.join(ROLES)}", "messages")
    r.messages = [_plain(m) for m in messages]
    tools = body.get("tools")
    functions = isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" for t in tools
    )
    if tools is not None and not functions:
        raise BadRequest("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    r.tools = tools or None
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise BadRequest("tool_choice: only 'auto' and 'none' are supported", "tool_choice")
    if body.get("tool_choice") == "none":
        r.tools = None


def _check_prompt(r: Request, body: dict) -> None:
    prompt = body.get("prompt")
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt))
    if not ok:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)", "prompt")
    r.prompt = prompt


def _plain(m: dict) -> dict:
    """A message as the chat template wants it: text content (OpenAI's list of text parts joined)."""
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if m.get("role") == "developer":
        m["role"] = "system"
    return m


def response_body(r: Request, model: str, choices: list[Choice], prompt_tokens: int) -> dict:
    """The non-streamed answer, in OpenAI's shape (token ids as vLLM's `token_ids` extension)."""
    created, rid = int(time.time()), ("chatcmpl-" if r.chat else "cmpl-") + uuid.uuid4().hex
    out = []
    for i, c in enumerate(choices):
        lp = _logprobs(r, c)
        if r.chat:
            message = {"role": "assistant", "content": c.content}
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            out.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "token_ids": c.token_ids,
                }
            )
        else:
            out.append(
                {
                    "index": i,
                    "text": c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "token_ids": c.token_ids,
                }
            )
    completion = sum(len(c.token_ids) for c in choices)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    kind = "chat.completion" if r.chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": out, "usage": usage}


def _logprobs(r: Request, c: Choice) -> dict | None:
    if not r.logprobs:
        return None
    if r.chat:
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(c.tokens, c.logprobs, strict=True)
            ]
        }
    return {"tokens": c.tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": None}


def stream_events(body: dict, chat: bool) -> list[dict]:
    """A finished answer as the chunks a streamed one is made of (one content chunk per choice)."""
    base = {k: body[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for c in body["choices"]:
        i = c["index"]
        if chat:
            m = c["message"]
            events.append(
                {
                    **base,
                    "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    ],
                }
            )
            delta: dict[str, Any] = {}
            if m.get("content"):
                delta["content"] = m["content"]
            if m.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(m["tool_calls"])]
            events.append(
                {
                    **base,
                    "choices": [
                        {"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
                    ],
                }
            )
            events.append(
                {**base, "choices": [{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}]}
            )
        else:
            events.append(
                {
                    **base,
                    "choices": [
                        {
                            "index": i,
                            "text": c["text"],
                            "logprobs": c["logprobs"],
                            "finish_reason": c["finish_reason"],
                        }
                    ],
                }
            )
    events.append({**base, "choices": [], "usage": body["usage"]})
    return events


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests (`self.server.endpoint` is the EndpointServer)."""

    protocol_version = "HTTP/1.1"  # keep-alive: an agent's requests reuse its connection
    # TCP_NODELAY: the body written after the headers must not wait for the client's delayed ACK
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:  # no line per request on stderr
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            data = [{"id": self.server.endpoint.model, "object": "model", "created": 0, "owned_by": "tandem"}]
            return self._json(200, {"object": "list", "data": data})
        self._json(404, _error(f"no route {self.path}", None, "not_found"))

    def do_POST(self) -> None:
        endpoint, path = self.server.endpoint, self.path.rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return self._json(404, _error(f"no route {self.path}", None, "not_found"))
        try:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except json.JSONDecodeError as e:
                raise BadRequest(f"the body is not JSON: {e}") from None
            request = check_request(path, body, self.headers.get(EPISODE_HEADER))
            choices, prompt_tokens = endpoint.backend(request)
        except BadRequest as e:
            endpoint.refused(self.headers.get(EPISODE_HEADER), e)
            return self._json(e.status, _error(str(e), e.param))
        answer = response_body(request, endpoint.model, choices, prompt_tokens)
        if not request.stream:
            return self._json(200, answer)
        payload = "".join(f"data: {json.dumps(e)}\n\n" for e in stream_events(answer, request.chat))
        self._send(200, (payload + "data: [DONE]\n\n").encode(), "text/event-stream")

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # every episode of a call may connect at once (default: 5)


class EndpointServer:
    """`backend(request) -> (choices, prompt_tokens)` behind an OpenAI-compatible HTTP API, on an
    ephemeral port of 127.0.0.1 (`base_url`); `backend` raises BadRequest to refuse a request, and
    `refused(episode id or None, error)` hears of every refusal (the checks here and the backend's)."""

    def __init__(
        self,
        backend: Callable[[Request], tuple[list[Choice], int]],
        model: str = "tandem",
        refused: Callable[[str | None, BadRequest], None] = lambda episode, error: None,
    ):
        self.backend, self.model, self.refused = backend, model, refused
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.endpoint = self
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-endpoint", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _error(message: str, param: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
