"""Load and save Hugging Face checkpoint directories (config.json + safetensors, sharded or not)."""

import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tandem import checksums
from tandem.errors import TandemError
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, meta_model
from tandem.model.experts import EXPERT_NAMES
from tandem.model.peft_format import ADAPTER_CONFIG, merge_adapter_file

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names; tandem casts any of them


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards its index names, or model.safetensors."""
    if (path / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise TandemError(
                f"{path / INDEX} is not a safetensors index ({type(e).__name__}: {e}); it must be JSON "
                'with a "weight_map" of weight name -> shard file.'
            ) from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise TandemError(f"{path / INDEX} names shard files that are not there: {', '.join(missing)}.")
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise TandemError(
        f"No model.safetensors or {INDEX} in {path}: expected a Hugging Face checkpoint directory."
    )


def _headers(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """name -> (shape, dtype, file) from the files' safetensors headers; no tensor is read."""
    found = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    found[name] = (tuple(view.get_shape()), view.get_dtype(), file)
        except (SafetensorError, OSError) as e:
            raise TandemError(f"Weights file {file} is not readable safetensors: {e}.") from None
    return found


# transformers>=5 `save_pretrained(save_original_format=False)`: a layer's experts fused in two tensors.
FUSED = re.compile(r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")
Weight = tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]  # shape, how to take it


def _as_tandem_names(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> dict[str, Weight]:
    """A checkpoint's weight -> {tandem's name: (shape, how to take it from the weight)}: the weight
    itself, except for the fused experts transformers>=5 writes when asked not to write the original
    format: `experts.gate_up_proj` (X, 2I, E), the gate rows first, and `experts.down_proj`
    (X, E, I), split into X experts; and Mixtral's under `mlp` where its checkpoints say
    `block_sparse_moe`."""
    m = FUSED.fullmatch(name) if cfg.num_experts else None
    if m is None or (m[2] != "gate.weight" and len(shape) != 3):
        return {name: (shape, lambda t: t)}
    block = f"{m[1]}.{'block_sparse_moe' if cfg.model_type == 'mixtral' else 'mlp'}"
    if m[2] == "gate.weight":  # the router
        return {f"{block}.gate.weight": (shape, lambda t: t)}
    gate, up, down = EXPERT_NAMES.get(cfg.model_type, ("gate_proj", "up_proj", "down_proj"))
    n, rows, cols = shape
    half = rows // 2
    parts = [(down, 0, rows)] if m[2] == "experts.down_proj" else [(gate, 0, half), (up, half, rows)]
    return {
        f"{block}.experts.{e}.{proj}.weight": ((b - a, cols), lambda t, e=e, a=a, b=b: t[e, a:b])
        for e in range(n)
        for proj, a, b in parts
    }


def check_checkpoint(path: str | Path, finite: bool = True) -> ModelConfig:
    """The checkpoint's config.json and weights agree, read from the safetensors headers (so the
    driver checks a model before any actor starts): every file present and readable, every weight
    the config implies there under its name with its shape and a floating-point dtype, and no weight
    the config does not imply. With `finite`, every weight is then read, one tensor at a time, and
    must hold no NaN or inf (`check_finite`). First, in a checkpoint tandem wrote, the files read
    here (config.json, the weights and their index, a LoRA adapter) must be as its checksums.json
    recorded them: a flipped byte inside a tensor passes every other check. Returns the config;
    TandemError naming the directory, file or weight otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise TandemError(f"Model path {path} does not exist or is not a directory.")
    if bad := checksums.damage(path, _read_here):
        raise TandemError(f"Checkpoint {path} is not as it was written: {'; '.join(bad.values())}.")
    cfg = ModelConfig.load(path)
    expected = {n: tuple(p.shape) for n, p in meta_model(cfg).named_parameters()}
    found = {
        tandem_name: (shape, dtype, file)
        for name, (have, dtype, file) in _headers(weight_files(path)).items()
        for tandem_name, (shape, _) in _as_tandem_names(name, have, cfg).items()
    }
    if cfg.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # tied: the embedding is the head
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(n for n in set(found) - set(expected) if not n.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise TandemError(
            f"Checkpoint {path} does not match its config.json: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}{' (and more)' if len(missing) > 5 or len(unexpected) > 5 else ''}."
        )
    for name, shape in expected.items():
        have, dtype, file = found[name]
        if have != shape:
            raise TandemError(
                f"Weight {name} in {file} has shape {list(have)}, but {path}/config.json implies "
                f"{list(shape)}: the weights and the config are of different models."
            )
        if dtype not in FLOAT_DTYPES:
            raise TandemError(
                f"Weight {name} in {file} is {dtype}; tandem loads floating-point weights "
                f"({', '.join(FLOAT_DTYPES)}), not quantized ones."
            )
    if finite:
        check_finite(weight_files(path))
    return cfg


def _read_here(name: str) -> bool:
    """Whether a checkpoint's file (its name relative to the directory) is one `check_checkpoint`
    and `load_model` read."""
    return "/" not in name and (
        name.endswith(".safetensors") or name in ("config.json", INDEX, ADAPTER_CONFIG)
    )


def check_finite(files: list[Path]) -> None:
    """Every tensor of the safetensors `files` is finite, or a TandemError naming the file and its
    first non-finite tensors. One tensor in memory at a time; the built-in models take ~20 ms."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            _refuse_non_finite(file, ((name, f.get_tensor(name)) for name in f.keys()))


def _refuse_non_finite(file: Path, tensors: Iterable[tuple[str, torch.Tensor]], shown: int = 3) -> None:
    """A model whose weights hold NaN or inf computes NaN losses: the non-finite guard would skip
    every train step and the run would end 'successfully' having learned nothing. Refuse it."""
    bad = [(name, t) for name, t in tensors if not torch.isfinite(t).all()]
    if not bad:
        return
    named = ", ".join(
        f"{name} ({int(t.isnan().sum())} NaN)" if t.isnan().any() else f"{name} ({int(t.isinf().sum())} inf)"
        for name, t in bad[:shown]
    )
    more = f" and {len(bad) - shown} more tensors" if len(bad) > shown else ""
    raise TandemError(
        f"Weights file {file} holds non-finite values in {named}{more}. Every loss computed from them "
        "would be NaN, so every train step would be skipped. Use a checkpoint without them (an earlier "
        "one of the run that wrote it, or the model as published)."
    )


def _read_tensors(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's weights by tandem's names (`_as_tandem_names`); TandemError on NaN or inf."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        loaded = load_file(str(file))
        _refuse_non_finite(file, loaded.items())  # in memory already: no second read of the file
        for name, t in loaded.items():
            for tandem_name, (_, take) in _as_tandem_names(name, tuple(t.shape), cfg).items():
                tensors[tandem_name] = take(t)
    return tensors


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """A CausalLM with the checkpoint's weights, cast to `dtype`, on `device`. A PEFT LoRA adapter
    beside them (adapter_config.json: a LoRA run's checkpoint) is folded in, as transformers applies
    it to the weights of its directory: the model is the policy the two make."""
    path = Path(path)
    cfg = check_checkpoint(path, finite=False)  # _read_tensors checks the values it reads
    tensors = _read_tensors(path, cfg)
    if (path / ADAPTER_CONFIG).is_file():
        had_head = "lm_head.weight" in tensors
        tensors = merge_adapter_file(tensors, path)
        if cfg.tie_word_embeddings and not had_head and "lm_head.weight" in tensors:
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # an adapted head: its own weight
    model = meta_model(cfg).to_empty(device=device)
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
