"""What the endpoint answers an OpenAI agent's request with: each engine sample as a `Choice`
(its text cut at the request's stop strings, its tool calls parsed), handed to the request where
it waits on the endpoint's loop."""

from __future__ import annotations

import asyncio

from tandem.agent.chat import parse_tool_calls
from tandem.agent.openai_request import BadRequest, Choice, Request
from tandem.sample import Sample


def answer(s: Sample, r: Request, tokenizer, tool_parser: str) -> tuple[Choice, str | None]:
    """The engine sample `s` -> the Choice `r` gets, and the parse error of a tool call that does
    not read (None when there is none)."""
    text = cut(tokenizer.decode(s.response_ids, skip_special_tokens=True), r.stop)
    finish = "length" if s.finish_reason == "length" else "stop"
    content, calls, parse_error = text, [], None
    if r.chat and r.tools:
        parsed = parse_tool_calls(text, tool_parser)
        content, calls, parse_error = parsed.content, parsed.tool_calls, parsed.parse_error
        if calls and finish == "stop":
            finish = "tool_calls"
    tokens = [tokenizer.decode([t]) for t in s.response_ids]
    return Choice(text, list(s.response_ids), list(s.logprobs), tokens, finish, content, calls), parse_error


def settle(future: asyncio.Future, answer: tuple[list[Choice], int] | BadRequest) -> None:
    """Hand a waiting request its answer (choices, prompt tokens) or its refusal."""
    if future.done():  # the request gave up waiting (past its episode's time limit)
        return
    if isinstance(answer, BadRequest):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def cut(text: str, stop: list[str]) -> str:
    """OpenAI's rule: the text ends before its first stop string."""
    found = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(found)] if found else text
