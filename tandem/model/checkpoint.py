"""Load and save Hugging Face checkpoint directories (config.json + safetensors, sharded or not)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.errors import TandemError
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM

INDEX = "model.safetensors.index.json"


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / INDEX).is_file():
        shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(path / shard)))
        return tensors
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    raise TandemError(
        f"No model.safetensors or {INDEX} in {path}: expected a Hugging Face checkpoint directory."
    )


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """A CausalLM with the checkpoint's weights, cast to `dtype`, on `device`."""
    path = Path(path)
    if not path.is_dir():
        raise TandemError(f"Model path {path} does not exist or is not a directory.")
    cfg = ModelConfig.load(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    tensors = _read_tensors(path)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {n for n, _ in model.named_parameters()}
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    unexpected = {n for n in unexpected if not n.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise TandemError(
            f"Checkpoint {path} does not match its config.json: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}."
        )
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name].to(dtype))
    return model.to(dtype)


def save_model(
    model: CausalLM,
    path: str | Path,
    max_shard_mb: float | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write config.json and safetensors (sharded with an index when over `max_shard_mb`).
    `tensors`: the weights by name when the model's own are shards (fsdp2 gathers them first)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    if tensors is None:
        tensors = dict(model.named_parameters())
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    if model.cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # shared with embed_tokens, as Hugging Face saves it
    limit = int(max_shard_mb * 2**20) if max_shard_mb else None
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if limit and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata=meta)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


ASSETS = Path(__file__).resolve().parent.parent / "assets"


def resolve_model_path(spec: str) -> Path:
    """A checkpoint directory, or "builtin:<task>" for the warm start shipped in tandem/assets."""
    if not spec.startswith("builtin:"):
        return Path(spec)
    name = spec.split(":", 1)[1]
    path = ASSETS / f"warmstart-{name}"
    if not path.is_dir():
        names = sorted(p.name.removeprefix("warmstart-") for p in ASSETS.glob("warmstart-*"))
        shipped = ", ".join(f"builtin:{n}" for n in names)
        raise TandemError(
            f"No built-in model {spec!r}. Built-in models: {shipped or 'none'}; make one with "
            f"`tandem sft recipes/sft-{name}.yaml` or point model.path at a checkpoint directory."
        )
    return path
