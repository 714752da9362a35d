"""LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors.

What `tandem.model.lora` trains, written as `peft.PeftModel.save_pretrained` writes it, so
`PeftModel.from_pretrained(base, dir)` loads it (and transformers, from a directory holding a base
model's weights and an adapter beside them, applies it); and such a directory read back, the
adapter folded into the weights (`merge_adapter_file`, which `load_model` uses).
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from tandem.config.schema import LORA_ALL_LINEAR
from tandem.errors import TandemError
from tandem.model.decoder import CausalLM
from tandem.model.lora import HEAD_WEIGHT, adapter_names, head_of_its_own

PEFT_PREFIX = "base_model.model."  # PEFT's names: a PeftModel's `base_model` (the tuner), its `model`
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT LoRA options that change what the saved tensors mean, which `merge_adapter_file` does not read
UNREAD = ("use_dora", "fan_in_fan_out", "lora_bias", "rank_pattern", "alpha_pattern")


def refuse_adapter_dir(path: Path) -> None:
    """TandemError when model.path is itself a PEFT adapter directory: train.lora trains a new adapter
    on model.path's weights, which would leave that one out (checked in the driver, with LoRA on)."""
    config = path / ADAPTER_CONFIG
    if config.is_file():
        try:
            base = json.loads(config.read_text()).get("base_model_name_or_path")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            base = None
        of = f" of the base {base}" if base else ""
        to_base = f"set model.path={base}" if base else "set model.path to its base"
        raise TandemError(
            f"model.path={path} is a PEFT adapter{of} ({config}), and train.lora trains a new adapter "
            f"on model.path's own weights, which would leave that one out. To train a new adapter on "
            f"its base, {to_base}; to go on training a tandem run's adapter, resume the run "
            "(run.resume); to build on the adapter's policy, merge it into a full checkpoint "
            "(a directory without adapter_config.json) and start from that."
        )


def adapter_state_dict(model: CausalLM, tensors: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The adapter as PEFT saves it: `base_model.model.<name>` -> tensor (on the CPU) for each of
    `adapter_names`. `tensors`: the weights by name when the model's own are shards (fsdp2)."""
    tensors = dict(model.named_parameters()) if tensors is None else tensors
    return {PEFT_PREFIX + n: tensors[n].detach().to("cpu").contiguous() for n in adapter_names(model)}


def peft_config(model: CausalLM, base_path: str = "") -> dict:
    """adapter_config.json's contents for PEFT's LoraConfig. A list of targets is written as given
    (PEFT matches it as `lora_targets` does); all-linear as the adapted modules' full names, as PEFT
    writes it, since its all-linear would also take an MoE block's shared expert."""
    a = model.adapters
    c = a.config
    targets = a.targets if c.target_modules == LORA_ALL_LINEAR else list(c.target_modules)
    return lora_config(c.rank, c.alpha, c.dropout, targets, list(c.modules_to_save), base_path)


def lora_config(
    rank: int, alpha: float, dropout: float, targets: list[str], modules_to_save: list[str], base_path: str
) -> dict:
    """adapter_config.json's contents for a plain LoRA adapter of these settings (`peft_config`'s)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path or None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "modules_to_save": modules_to_save or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def save_adapter(
    model: CausalLM, path: str | Path, base_path: str = "", tensors: Mapping[str, Tensor] | None = None
) -> None:
    """Write adapter_config.json and adapter_model.safetensors into `path`, what
    `peft.PeftModel.from_pretrained(base, path)` loads. base_path: the base checkpoint's directory
    (adapter_config's base_model_name_or_path); tensors as `adapter_state_dict`'s."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config(model, base_path), indent=2))
    save_file(adapter_state_dict(model, tensors), str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def merge_adapter_file(tensors: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """A checkpoint's weights by tandem's names with the PEFT LoRA adapter saved beside them in
    `path` folded in (W + s · B @ A in fp32, s = lora_alpha / r, or / √r with use_rslora; a module
    trained whole replaces its weight): what transformers loads from such a directory. An adapter on
    a head tied to the embedding gives the head a weight of its own (`lm_head.weight` in the result:
    the model is then untied, `load_model`). TandemError for an adapter this does not read exactly."""
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        r, alpha = config["r"], config["lora_alpha"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise TandemError(
            f"{path / ADAPTER_CONFIG} is not a PEFT LoRA config ({type(e).__name__}: {e})."
        ) from None
    unread = [k for k in UNREAD if config.get(k)]
    if config.get("peft_type") != "LORA" or unread:
        raise TandemError(
            f"{path / ADAPTER_CONFIG} is a PEFT adapter tandem cannot fold into the weights beside it "
            f"(peft_type {config.get('peft_type')!r}{', ' + ', '.join(unread) if unread else ''}): tandem "
            "reads plain LoRA. Merge it with PEFT (merge_and_unload) and save the result instead."
        )
    scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    adapter = {k.removeprefix(PEFT_PREFIX): t for k, t in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    out = dict(tensors)
    for name, t in adapter.items():
        module, _, kind = name.rpartition(".lora_")
        if kind == "B.weight":
            continue
        target = f"{module}.weight" if kind == "A.weight" else name
        if target == HEAD_WEIGHT:
            head_of_its_own(out)
        if target not in out:
            raise TandemError(
                f"{path / ADAPTER_WEIGHTS} holds {name}, for {target}, which the model has not."
            )
        if kind == "A.weight":
            weight = out[target]
            delta = adapter[f"{module}.lora_B.weight"].float() @ t.float()
            out[target] = (weight.float() + scaling * delta).to(weight.dtype)
        else:
            out[name] = t
    return out
