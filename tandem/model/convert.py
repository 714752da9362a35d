"""`tandem convert`: a GGUF file or a Hugging Face checkpoint directory, written as the directory
tandem loads (config.json without quantization_config, one float32 model.safetensors, the
tokenizer with its chat template, generation_config.json).

Float32, not bfloat16: a GGUF's dequantised weights (a scale times a 4- or 8-bit integer, plus a
minimum) are exact in float32, so the converted model computes what the GGUF does; bfloat16 would
round them again. tandem casts to model.dtype on load, so a bf16 run loses nothing by it.

The directory appears whole or not at all: it is written into a temporary sibling and renamed into
place, so a failure (a damaged file, a full disk, Ctrl-C) leaves nothing half-written. That sibling
is made before the source is read, so a place that cannot be written is refused in milliseconds, not
after a minute of dequantising. Each step is said on stderr as it starts: SmolLM2-135M's GGUF takes
25 to 60 s on a CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.errors import TandemError
from tandem.model.gguf import CheckModel, Say, read_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Converted:
    """What `convert_checkpoint` wrote."""

    path: Path
    source: Path
    model_type: str
    parameters: int  # tied embeddings counted once
    vocab_size: int
    dtype: str = "float32"

    def line(self) -> str:
        return (
            f"wrote {self.path}: {self.model_type}, {self.parameters / 1e6:.1f}M parameters, "
            f"vocabulary {self.vocab_size}, {self.dtype} (from {self.source})"
        )


def convert_checkpoint(
    src: str | Path, out: str | Path, check_model: CheckModel, say: Say | None = None
) -> Converted:
    """Convert `src` (a .gguf file, or a checkpoint directory transformers loads) into the new
    directory `out`, saying what it does as it goes (`say`; by default `timed_stderr`).
    `check_model` (ModelConfig.from_hf) refuses, before any weight is read, a model tandem cannot
    run. TandemError naming the file otherwise; `out` is then left absent."""
    src, out, say = Path(src), Path(out), say or timed_stderr()
    if not (src.is_file() or src.is_dir()):
        raise TandemError(f"{src} does not exist: give a .gguf file or a Hugging Face checkpoint directory.")
    with aside(out) as partial:
        model, tokenizer = (read_gguf if src.is_file() else read_hf_dir)(src, check_model, say)
        say(f"writing {out}")
        write(model, tokenizer, partial)
    cfg = model.config
    return Converted(out, src, cfg.model_type, model.num_parameters(), cfg.vocab_size)


def timed_stderr() -> Say:
    """A `Say` that prints each line to stderr after the seconds since this call."""
    start = time.monotonic()

    def say(line: str) -> None:
        print(f"convert [{time.monotonic() - start:.0f} s] {line}", file=sys.stderr, flush=True)

    return say


@contextlib.contextmanager
def aside(out: Path) -> Iterator[Path]:
    """A new directory beside `out` for the block to write into, renamed to `out` when the block
    ends and removed, with the folders made for it, when it raises. Made first, so the place is
    checked before the block reads anything: TandemError naming `out` (as given, never the hidden
    sibling) when it exists or cannot be written there."""
    if out.exists():
        raise TandemError(f"{out} exists already; give `tandem convert` a new directory to write.")
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # innermost first
    # Not tempfile.mkdtemp: its 0700 would keep the directory from the others sharing a cache.
    partial = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        _remove(made)
        raise TandemError(_unwritable(out, e)) from None
    try:
        yield partial
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        _remove(made)
        raise


def _unwritable(out: Path, e: OSError) -> str:
    base = next(p for p in out.parents if p.exists())  # "." at the latest
    why = f"{base} is not a directory" if not base.is_dir() else f"{e.strerror or e} in {base}"
    return f"Cannot write {out}: {why}. Give `tandem convert` a new directory in a folder you can write to."


def _remove(folders: list[Path]) -> None:
    for folder in folders:  # innermost first; one another process has written into stays
        with contextlib.suppress(OSError):
            folder.rmdir()


def read_hf_dir(
    path: Path, check_model: CheckModel, say: Say
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A checkpoint directory's model in float32 and its tokenizer, as transformers loads them (any
    dtype, sharded or not), saying each step as it starts; TandemError when it has no config.json,
    is quantised, or is of a family tandem does not run."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.data.tokenizer import load_tokenizer

    file = path / "config.json"
    if not file.is_file():
        raise TandemError(
            f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory (it has no "
            "config.json). Give a .gguf file, or a directory as save_pretrained writes it."
        )
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TandemError(f"{file} is not valid JSON: {e}.") from None
    if not isinstance(hf, dict):
        raise TandemError(f"{file} must hold a JSON object, not a {type(hf).__name__}.")
    if "quantization_config" in hf:
        method = (hf["quantization_config"] or {}).get("quant_method", "an unnamed method")
        raise TandemError(
            f"{file}: the checkpoint is quantised ({method}); tandem converts float checkpoints and GGUF "
            "files. Convert the unquantised model, or its GGUF file."
        )
    check_model(hf, str(file))
    say(f"reading {path} in float32 ({hf.get('model_type')}, {hf.get('num_hidden_layers')} layers)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        reason = " ".join(str(e).split())
        raise TandemError(f"transformers could not load the weights of {path}: {reason}") from None
    say("reading the tokenizer")
    return model, load_tokenizer(path)


def write(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """config.json (every field, not only those that differ from transformers' defaults: tandem
    reads config.json with its own; quantization_config dropped: transformers would treat the
    weights as quantised; the _name_or_path of this machine dropped),
    model.safetensors (float32; a tied head left out, as save_pretrained leaves it), the tokenizer
    files and generation_config.json into the existing directory `path`."""
    import torch
    from safetensors.torch import save_file

    hf = model.config.to_dict()
    hf = {k: v for k, v in hf.items() if k != "quantization_config" and not k.startswith("_")}
    hf |= {"architectures": [type(model).__name__], "dtype": "float32"}
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {n: t.detach().to(torch.float32).contiguous() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding is the head
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes through a 0600 temporary file: give it the mode the umask gave config.json
    os.chmod(path / "model.safetensors", (path / "config.json").stat().st_mode & 0o777)
    tokenizer.save_pretrained(str(path))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(path))
