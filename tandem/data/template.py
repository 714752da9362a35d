"""Prompt rendering: a `Prompt` to the exact text and token ids the policy sees.

Chat prompts go through the tokenizer's own chat template (`apply_chat_template`, generation
prompt added), so the built-in tokenizer and any Hugging Face one take the same path. Plain-text
prompts are used as they are. Encoding never adds special tokens beyond what the template wrote
(as verl and TRL do), so a template that writes a bos token does not get a second one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.errors import TandemError
from tandem.sample import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """The prompt text: chat messages through the chat template with the generation prompt, else `text`."""
    if prompt.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise TandemError(
                f"The dataset has chat prompts (data source {prompt.data_source!r}) but the tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat "
                "template. Use a tokenizer with a chat template (an instruct model's), or plain-text "
                "prompts (a string in the prompt column)."
            )
        return tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    if prompt.text is not None:
        return prompt.text
    raise TandemError(f"A prompt (data source {prompt.data_source!r}) has neither messages nor text.")


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    max_prompt_length: int,
    source: str = "",
    limit_reason: str = "",
    rows: list[int] | None = None,
) -> list[list[int]]:
    """Token ids of each rendered prompt, without added special tokens.

    Raises TandemError naming the row (`rows[i]` for the i-th prompt, default i), its length, the
    limit and `source` (the dataset file) when a prompt has more than `max_prompt_length` tokens,
    since truncating it would silently change the task. `limit_reason` says where the limit comes
    from when it is not data.max_prompt_length.
    """
    texts = [render_prompt(tokenizer, p) for p in prompts]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for i, row_ids in enumerate(ids):
        row = rows[i] if rows is not None else i
        if len(row_ids) > max_prompt_length:
            where = f" of {source}" if source else ""
            reason = limit_reason or (
                f"data.max_prompt_length={max_prompt_length}. Raise data.max_prompt_length (the model's "
                "context length, the prompt plus the response, is the upper limit)"
            )
            raise TandemError(
                f"Prompt at row {row}{where} is {len(row_ids)} tokens long, more than the limit of "
                f"{max_prompt_length} set by {reason}, or remove or shorten the long prompts in the dataset."
            )
    return [list(row_ids) for row_ids in ids]
