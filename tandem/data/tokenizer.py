"""Tokenizers: the built-in byte-level one, and loading/saving any tokenizer through `transformers`.

The built-in tokenizer lets tandem run with no download. It is a byte-level BPE with no merges —
Qwen2's tokenizer format with an empty merge list — so every byte of the UTF-8 text is one token
(one token per character for ASCII), and `transformers.AutoTokenizer` rebuilds exactly the same
tokenizer from a checkpoint whose config says `qwen2`. Fixed ids:

    0 <|pad|>   1 <|endoftext|> (bos)   2 <|im_start|>   3 <|im_end|> (eos)   4 <|unk|>
    5 + b       byte b (0..255), written as GPT-2's printable byte characters ("\n" is "Ċ")

261 tokens in all. A response ends at eos `<|im_end|>`, as in Qwen's ChatML. Encoding adds no
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
# Qwen2's pre-tokenizer split; with no merges it changes no token, but matching it keeps the
# tokenizer identical to the one transformers builds for a qwen2 checkpoint.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML with no default system message, so a prompt is only what the dataset wrote.
# Tool calling in Hermes' / Qwen's format: with `tools`, a system turn lists them (after the first
# system message's text, which it replaces) as `<tools>name(arg, ...)</tools>`, one per line: not
# Qwen's JSON schemas, since this tokenizer spends a token per character and a tiny model needs
# only the names; an assistant message's tool_calls are written
# <tool_call>{"name": ..., "arguments": ...}</tool_call> after its text; a message without content
# renders it empty. Messages without tools render exactly as plain ChatML (tests/test_openai_agent.py
# checks it against the plain template).
CHATML_TEMPLATE = (
    "{%- set first = 0 %}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{%- set first = 1 %}"
    "{%- endif %}"
    "{{ '<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool['function'] if 'function' in tool else tool %}"
    "{{ f['name'] + '(' + ((f.get('parameters') or {}).get('properties') or {}) | list | join(', ') + ')' }}"
    "{{ '\\n' if not loop.last else '' }}"
    "{%- endfor %}"
    "{{ '</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[first:] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (args if args is string else args | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_characters() -> list[str]:
    """GPT-2's map of the 256 bytes to printable characters: byte b -> byte_characters()[b]."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:  # bytes that are not printable move past 255, in order
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in byte-level tokenizer (ids in the module docstring) with a ChatML template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + byte_characters())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
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


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `AutoTokenizer.from_pretrained(path)`: a saved directory or a Hugging Face id.

    Raises TandemError naming `path` when it is missing or holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    local = os.path.isabs(path) or path.startswith(".") or os.path.exists(path)
    if local and not os.path.isdir(path):
        raise TandemError(
            f"Tokenizer directory {path!r} does not exist. Give a directory written by save_tokenizer "
            "or by a Hugging Face model's save_pretrained (it holds tokenizer.json or "
            "tokenizer_config.json), or a Hugging Face model id."
        )
    try:
        # Nothing is downloaded at run time: a name that is not a local directory must be in the cache.
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
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
