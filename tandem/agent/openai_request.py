"""What the OpenAI-compatible endpoint accepts (`openai_server.py` serves it): a request's JSON
checked into a `Request`, or refused with `BadRequest` naming the field; and the `Choice`s the
agent's dispatcher answers it with. Plain Python, no web or `openai` import: `openai_agent.py`
uses it before (and without) starting the server.

Every request names its episode in the `X-Tandem-Episode` header: the client tandem gives each
agent sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
