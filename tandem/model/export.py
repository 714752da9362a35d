"""A LoRA checkpoint as the tools around tandem take it: `tandem eval` / `generate` serve one, and
`tandem export` writes one out (docs/training.md, "LoRA").

A LoRA checkpoint comes two ways: a LoRA run's step directory (the base's weights, and beside them
the adapter as PEFT saves it: adapter_config.json + adapter_model.safetensors), which `load_model`
reads as the policy; or a PEFT adapter directory alone, whose adapter_config.json names its base
(base_model_name_or_path), which `checkpoint_dir` lays out as the first kind.
"""

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open

from tandem.data.tokenizer import load_tokenizer
from tandem.dtypes import DTYPES
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model, save_model, weight_files
from tandem.model.config import model_dir, resolve_model_path
from tandem.model.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # a directory with weights holds one
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def adapter_only(path: Path) -> bool:
    """A PEFT adapter directory without weights of its own (its base is elsewhere)."""
    return (path / ADAPTER_CONFIG).is_file() and not any((path / w).is_file() for w in WEIGHTS)


def adapter_base(path: Path) -> Path:
    """The base checkpoint directory a PEFT adapter directory names (base_model_name_or_path: a
    path, absolute or from the working directory, builtin:<task>, or a Hugging Face hub id).
    TandemError when it names none, or none that is a checkpoint directory here."""
    config = path / ADAPTER_CONFIG
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise TandemError(f"{config} is not a PEFT adapter config ({type(e).__name__}: {e}).") from None
    if not base:
        raise TandemError(
            f"{path} is a PEFT adapter without weights of its own, and its {ADAPTER_CONFIG} names no "
            "base model (base_model_name_or_path): set it to the directory of the checkpoint it was "
            "trained on."
        )
    named = f"{path} is a PEFT adapter of the base {base!r} ({ADAPTER_CONFIG}'s base_model_name_or_path)"
    try:
        found = resolve_model_path(base)  # a Hugging Face hub id too, from huggingface_hub's cache
    except TandemError as e:
        raise TandemError(f"{named}: {e}") from None
    if not found.is_dir() or adapter_only(found):
        raise TandemError(
            f"{named}, which is not a checkpoint directory here. Set base_model_name_or_path to the "
            "directory of the checkpoint it was trained on, builtin:<name>, or a Hugging Face hub id."
        )
    return found


@contextmanager
def checkpoint_dir(spec: str | Path, key: str = "the checkpoint") -> Iterator[Path]:
    """The checkpoint directory `spec` names ("builtin:" resolved), as tandem loads it: itself when
    it holds weights (an adapter beside them is folded in by `load_model`); for a PEFT adapter
    directory alone, a temporary directory of links to its base's files and to the adapter's,
    which win (its tokenizer, if it saved one): the layout of a LoRA run's step directory, for the
    block's duration. `key`: what names `spec` in errors (a config key or a flag)."""
    path = model_dir(str(spec), key)
    if not adapter_only(path):
        yield path
        return
    base = adapter_base(path)
    with tempfile.TemporaryDirectory(prefix="tandem-adapter-") as tmp:
        view = Path(tmp) / path.resolve().name  # the name the model goes by (an agent's model name)
        yield _links(view, base, path)


def base_files(path: Path, into: Path) -> Path:
    """`into`, made a directory of links to the files of `path` but its adapter's: the base of a
    LoRA step directory, for a reader that would take adapter_model.safetensors for a shard of
    the model (vLLM loads every *.safetensors of a directory without an index)."""
    return _links(into, path, skip=(ADAPTER_CONFIG, ADAPTER_WEIGHTS))


def _links(view: Path, *sources: Path, skip: tuple[str, ...] = ()) -> Path:
    """`view`, a new directory of links to the files of `sources` (a later source's file wins)."""
    view.mkdir(parents=True, exist_ok=True)
    for source in sources:
        for file in source.iterdir():
            if file.is_file() and file.name not in skip:
                (view / file.name).unlink(missing_ok=True)
                (view / file.name).symlink_to(file.resolve())
    return view


def export_checkpoint(spec: str | Path, out: str | Path, merge: bool, dtype: str = "") -> Path:
    """Write the LoRA checkpoint at `spec` (`checkpoint_dir`) into the new directory `out` with its
    tokenizer -> `out`. merge: a full Hugging Face checkpoint with the adapter folded into the
    weights (W + s · B @ A in fp32, as `load_model` folds it), in `dtype` (default: the base's),
    which transformers' AutoModelForCausalLM loads as the policy; else the adapter alone in PEFT's
    format (adapter_config.json naming its base, adapter_model.safetensors), what
    `peft.PeftModel.from_pretrained` and vLLM's LoRA serving load."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TandemError(f"tandem export: --out {out} exists and is not an empty directory.")
    if dtype and dtype not in DTYPES:
        raise TandemError(f"tandem export: --dtype {dtype!r}; valid: {', '.join(DTYPES)}.")
    with checkpoint_dir(spec) as path:
        if not (path / ADAPTER_CONFIG).is_file():
            raise TandemError(
                f"tandem export: {spec} holds no LoRA adapter ({ADAPTER_CONFIG}): it is a full "
                "Hugging Face checkpoint already, which transformers loads as it is."
            )
        tokenizer = load_tokenizer(path)
        if merge:
            dtype = dtype or stored_dtype(path)
            save_model(load_model(path, DTYPES[dtype]), out)
            config = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
        else:
            out.mkdir(parents=True, exist_ok=True)
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                shutil.copyfile(path / name, out / name)
        tokenizer.save_pretrained(str(out))
    return out


def stored_dtype(path: Path) -> str:
    """The dtype most of a checkpoint's weights are stored in, by tandem's name ("bfloat16")."""
    counts: Counter[str] = Counter()
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            counts.update(f.get_slice(name).get_dtype() for name in f.keys())
    stored = counts.most_common(1)[0][0]
    return SAFETENSORS_DTYPES.get(stored, "float32")
