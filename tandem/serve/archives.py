"""A checkpoint as files a client on another machine takes away, and the signed URLs that fetch
them without the API key (Tinker's are signed storage URLs: a plain GET, as `urllib` makes it).

- The archive, `archive.tar` (what `get_checkpoint_archive_url` points to, laid out as Tinker's): a
  LoRA checkpoint's PEFT adapter (adapter_config.json, its base_model_name_or_path the served base
  model's name; adapter_model.safetensors) beside the tokenizer's files and an empty
  `checkpoint_complete`. What `peft.PeftModel.from_pretrained(base, dir)` loads, and the cookbook's
  `weights.build_hf_model` merges. A full-weights checkpoint's Hugging Face weights instead.
- The merged model, `merged.tar`: the adapter folded into the base's weights (W + s · B @ A in fp32,
  `tandem.model.export.export_checkpoint`), a Hugging Face checkpoint with its tokenizer that
  `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads alone.
- save_weights_external's files one by one (`members`, without `checkpoint_complete`); with
  age_encryption_recipients each is encrypted to them as it is sent and named `<file>.age`, as
  Tinker stores them (the cookbook's `weights.download` of a training checkpoint asks for that).

A sampler checkpoint lives as a snapshot, its adapter's tensors (`tandem.serve.snapshots`): it is
laid out as a checkpoint first (`sampler_dir`), the base's files linked beside the adapter.
"""

import hashlib
import hmac
import io
import json
import secrets
import tarfile
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from tandem.config.schema import LoraConfig
from tandem.errors import TandemError
from tandem.model.export import export_checkpoint
from tandem.model.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, lora_config
from tandem.serve.checkpoints import META, REST
from tandem.serve.futures import NotFound
from tandem.serve.hub import tokenizer_files

COMPLETE = "checkpoint_complete"  # Tinker's archives end with it; its CLI refuses one without
AGE = ".age"  # an encrypted file's suffix
MAX_RECIPIENTS = 10  # the SDK's
KINDS = ("archive.tar", "merged.tar")
NOT_SHIPPED = (META, REST, "checksums.json")  # the service's own records


def members(where: Path, base_model: str) -> dict[str, Path | bytes]:
    """What a client takes of the checkpoint at `where`: name -> a file, or its bytes when rewritten.
    A LoRA checkpoint: its adapter (naming `base_model`) and tokenizer; else its every file but
    the service's records (the Hugging Face weights, config and tokenizer)."""
    config = where / ADAPTER_CONFIG
    if not config.is_file():
        files = [p for p in sorted(where.iterdir()) if p.is_file() and not p.name.startswith(".")]
        return {p.name: p for p in files if p.name not in NOT_SHIPPED}
    adapter = {**json.loads(config.read_text()), "base_model_name_or_path": base_model}
    files: dict[str, Path | bytes] = {ADAPTER_CONFIG: json.dumps(adapter, indent=2).encode()}
    files[ADAPTER_WEIGHTS] = where / ADAPTER_WEIGHTS
    files.update({p.name: p for p in tokenizer_files(where)})
    return files


def write_archive(where: Path, base_model: str, merged: bool, out: Path) -> None:
    """The tar `out` of the checkpoint at `where`: its `members`, or (merged) the Hugging Face
    model with the adapter folded in; `checkpoint_complete` last. Slow for `merged` (a whole
    model written twice): run it off the event loop."""
    with tempfile.TemporaryDirectory(prefix="tandem-merged-") as tmp:
        files = members(where, base_model)
        if merged and (where / ADAPTER_CONFIG).is_file():
            model = export_checkpoint(where, Path(tmp) / "model", merge=True)
            files = {p.name: p for p in sorted(model.iterdir()) if p.is_file()}
        with tarfile.open(out, "w", dereference=True) as tar:  # a sampler's view links the base's files
            for name, source in {**files, COMPLETE: b""}.items():
                if isinstance(source, Path):
                    tar.add(source, arcname=name, recursive=False)
                else:
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(source), int(time.time()), 0o644
                    tar.addfile(info, io.BytesIO(source))


def sampler_dir(weights: dict[str, Tensor], base: Path, lora: LoraConfig, into: Path) -> Path:
    """A sampler snapshot of a LoRA model (its adapters' tensors by tandem's names) laid out as a
    LoRA checkpoint in `into`: links to the base's files (`base`, the served model's directory) and
    the adapter as PEFT saves it, its rank read off the tensors, `lora`'s alpha and dropout."""
    a_weights = [t for n, t in weights.items() if n.endswith(".lora_A.weight")]
    if not a_weights:
        raise TandemError(
            "A full-weights sampler checkpoint is not archived: save_state, then download that "
            "checkpoint (tinker://<model_id>/weights/<name>)."
        )
    into.mkdir(parents=True, exist_ok=True)
    for file in base.iterdir():
        if file.is_file():
            (into / file.name).symlink_to(file.resolve())
    targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in weights})
    config = lora_config(a_weights[0].shape[0], lora.alpha, lora.dropout, targets, [], "")
    (into / ADAPTER_CONFIG).write_text(json.dumps(config))
    tensors = {PEFT_PREFIX + n: t.contiguous() for n, t in weights.items()}
    save_file(tensors, str(into / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return into


def age_recipients(keys: list[str]) -> list:
    """age recipients (native `age1...` or SSH public keys) parsed with pyrage; a TandemError naming
    the first bad one, or saying pyrage is missing."""
    try:
        import pyrage
    except ImportError:
        raise TandemError(
            "age_encryption_recipients needs pyrage where the service runs (pip install pyrage)."
        ) from None
    if len(keys) > MAX_RECIPIENTS:
        raise TandemError(f"{len(keys)} age_encryption_recipients: at most {MAX_RECIPIENTS}.")
    parsed = []
    for key in keys:
        kind = pyrage.ssh if key.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(key))
        except pyrage.RecipientError as e:
            raise TandemError(
                f"age recipient {key[:80]!r} is not an age1... or SSH public key: {e}."
            ) from None
    return parsed


def encrypt(source: Path | bytes, keys: list[str], out: Path) -> Path:
    """`source` encrypted to the age recipients `keys`, written to `out`."""
    import pyrage

    data = source.read_bytes() if isinstance(source, Path) else source
    out.write_bytes(pyrage.encrypt(data, age_recipients(keys)))
    return out


class Signer:
    """Download URLs signed with a secret drawn at start (HMAC-SHA256 of what they fetch and until
    when): they work without the API key until they expire, and end with the service."""

    def __init__(self):
        self.secret = secrets.token_bytes(32)

    def sign(self, target: str, expires: int) -> str:
        return hmac.new(self.secret, f"{target}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def check(self, target: str, expires: int, signature: str) -> None:
        """NotFound for a signature that is not this service's for `target`, or one past `expires`."""
        if not hmac.compare_digest(self.sign(target, expires), signature) or time.time() > expires:
            raise NotFound(
                f"This download URL of {target!r} is not valid (expired, or signed by another start of "
                "the service): ask for a new one (get_checkpoint_archive_url, get_external_weights_urls)."
            )
