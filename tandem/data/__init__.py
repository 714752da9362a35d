"""Prompt datasets, tokenizers, prompt rendering and synthetic verifiable tasks.

Importing this package does not import `transformers`; the tokenizer functions load it when called.
"""

from tandem.data.dataset import load_prompts, prompts_from_rows, save_rows
from tandem.data.tasks import TASKS, Task, make_dataset, split_of
from tandem.data.template import encode_prompts, render_prompt
from tandem.data.tokenizer import build_char_tokenizer, load_tokenizer, save_tokenizer

__all__ = [
    "TASKS",
    "Task",
    "build_char_tokenizer",
    "encode_prompts",
    "load_prompts",
    "load_tokenizer",
    "make_dataset",
    "prompts_from_rows",
    "render_prompt",
    "save_rows",
    "save_tokenizer",
    "split_of",
]
