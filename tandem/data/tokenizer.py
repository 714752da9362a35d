"""Tokenizers: the built-in character-level one, and loading/saving any tokenizer through `transformers`.

The built-in tokenizer lets tandem run with no download: one token per character of printable
ASCII (32..126) plus "\\n", and five special tokens, with fixed ids:

    0 <|pad|>   1 <|endoftext|> (bos)   2 <|im_start|>   3 <|im_end|> (eos)   4 <|unk|>
    5 "\\n"      6..100 chr(32)..chr(126)

101 tokens in all. A response ends at eos `<|im_end|>`, as in Qwen's ChatML. Encoding adds no
special tokens by itself; only the chat template writes `<|im_start|>` / `<|im_end|>`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tandem.errors import TandemError

if TYPE_CHECKING:  # transformers takes seconds to import; only the functions that need it load it
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, IM_START, IM_END, UNK = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, IM_END, UNK]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]

# Qwen-style ChatML with no default system message, so a prompt is only what the dataset wrote.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in character-level tokenizer (ids in the module docstring) with a ChatML template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
    core.decoder = decoders.Fuse()  # join tokens with no separator
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,  # " ." must decode to " .", not "."
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str) -> str:
    """Write `tokenizer` in Hugging Face's format (tokenizer.json, config, template); return out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `AutoTokenizer.from_pretrained(path)`: a saved directory or a Hugging Face id.

    Raises TandemError naming `path` when it is missing or holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    local = os.path.isabs(path) or path.startswith(".") or os.path.exists(path)
    if local and not os.path.isdir(path):
        raise TandemError(
            f"Tokenizer directory {path!r} does not exist. Give a directory written by save_tokenizer "
            "or by a Hugging Face model's save_pretrained (it holds tokenizer.json or "
            "tokenizer_config.json), or a Hugging Face model id."
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError or others for a bad directory
        names = sorted(os.listdir(path)) if local else []
        held = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        where = (
            f"the directory {path!r} (it holds: {held or 'nothing'})"
            if local
            else f"{path!r}, which is not a local directory, as a Hugging Face model id (cache, then hub)"
        )
        reason = " ".join(str(e).split())  # one paragraph, as a TandemError should be
        raise TandemError(
            f"Could not load a tokenizer from {where}: {type(e).__name__}: {reason} A tokenizer directory "
            "holds tokenizer.json or tokenizer_config.json, as written by save_tokenizer or save_pretrained."
        ) from e
