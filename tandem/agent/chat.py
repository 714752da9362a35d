"""Chat messages to token ids and back, for the OpenAI-compatible endpoint (`openai_agent.py`).

`ChatRenderer` renders a conversation with the model's own chat template and, when a request
extends the conversation an earlier request of the same episode was served (its messages, then the
assistant message the endpoint returned, then new messages), builds the new prompt from the earlier
prompt ids + the completion ids the engine generated + the ids of only what is new: token in, token
out. Text already sampled is never re-tokenized (re-tokenizing it can give other ids than the model
sampled, and then the trainer would score tokens the policy never chose).

What is new is taken from the template itself: the text it writes after an assistant message
(`turn_suffix`, e.g. "<|im_end|>\\n": its part past the model's own end-of-turn token when the
completion ended on one) and, from rendering the whole conversation, everything after the assistant
message. That needs the template to render a conversation's prefix as a prefix of the whole
(Qwen's, Hermes', Llama 3's do); where it does not, the request starts a new sample.

Tool calls in the template's own format: `parse_tool_calls` reads Hermes' and Qwen's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and Llama 3's JSON
`{"name": ..., "parameters": {...}}`, into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tandem.errors import TandemError
from tandem.registry import Registry

_SENTINEL = "\x00tandem-sentinel\x00"


class ChatRenderer:
    """The chat template of `tokenizer`, for the endpoint."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise TandemError(
                "The OpenAI endpoint renders chat messages with the model's chat template, and the "
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has none. Use a tokenizer with "
                "a chat template (an instruct model's), or /v1/completions with a plain prompt."
            )
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else ""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.text(probe, None, generation_prompt=False)
        self.turn_suffix = text[text.index(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in text else ""

    def text(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = True) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A fresh prompt: the whole conversation rendered, then tokenized."""
        return self.encode(self.text(messages, tools))

    def continuation(
        self, served: list[dict], new: list[dict], tools: list[dict] | None, ended_on_eos: bool
    ) -> list[int] | None:
        """Ids of what follows a served completion: the rest of its turn's markup, then `new`
        rendered up to the next generation prompt. `served`: the messages of the earlier request
        plus the assistant message returned for it. None when the template does not render
        `served` as a prefix of `served + new`."""
        head = self.text(served, tools, generation_prompt=False)
        whole = self.text(served + new, tools)
        if not whole.startswith(head):
            return None
        closing = self.turn_suffix
        if ended_on_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return self.encode(closing + whole[len(head) :])


@dataclass
class ParsedTurn:
    """An assistant turn as the endpoint returns it: content and OpenAI tool_calls."""

    content: str | None
    tool_calls: list[dict]
    parse_error: str | None = None  # why a tool call in the text could not be read (then plain content)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# The tool-call formats a model may write, one parser each: completion text -> ParsedTurn. A new
# format is one registered function (rollout.tool_parser names it).
TOOL_PARSERS: Registry[Callable[[str], ParsedTurn]] = Registry("tool parser")


def parse_tool_calls(text: str, parser: str = "hermes") -> ParsedTurn:
    """`text` (the completion, special tokens dropped) -> content and tool calls. A call whose JSON
    does not parse or lacks a name is not a call: the whole text comes back as content, with the
    reason in `parse_error` (counted as agent/tool_parse_errors), never an exception."""
    return TOOL_PARSERS.get(parser)(text)


@TOOL_PARSERS.register("hermes")
def _hermes(text: str) -> ParsedTurn:
    """Qwen's and Hermes' format: each call a JSON object inside <tool_call>...</tool_call>."""
    blocks = _HERMES.findall(text)
    if not blocks:
        if "<tool_call>" in text:
            return ParsedTurn(text, [], "a <tool_call> without its </tool_call>")
        return ParsedTurn(text, [])
    calls = []
    for block in blocks:
        call, why = _read_call(block, "arguments")
        if why:
            return ParsedTurn(text, [], why)
        calls.append(call)
    content = _HERMES.sub("", text).strip()
    return ParsedTurn(content or None, calls)


@TOOL_PARSERS.register("llama3_json")
def _llama3_json(text: str) -> ParsedTurn:
    """Llama 3's format: the whole turn one JSON object {"name", "parameters"} (after <|python_tag|>)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(text, [])
    call, why = _read_call(body, "parameters")
    return ParsedTurn(text, [], why) if why else ParsedTurn(None, [call])


def _read_call(body: str, arguments_key: str) -> tuple[dict, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return {}, f"tool call JSON does not parse ({e.msg} at {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return {}, "tool call JSON has no string 'name'"
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return {}, f"tool call '{arguments_key}' is not an object"
    function = {"name": obj["name"], "arguments": json.dumps(args)}
    return {"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function", "function": function}, None


def same_message(sent: dict, served: dict) -> bool:
    """Whether an assistant message the agent sent back is the one the endpoint returned: same
    content and the same calls (names and arguments, as JSON values; ids and key order aside)."""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or None) != (served.get("content") or None):
        return False

    def calls(m: dict) -> list[tuple[str, object]]:
        out = []
        for c in m.get("tool_calls") or []:
            f = c.get("function", {})
            try:
                args = json.loads(f.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                args = f.get("arguments")
            out.append((f.get("name"), args))
        return out

    return calls(sent) == calls(served)
