"""VllmAdapter: a LoRA run's adapter on vLLM's own LoRA path (train.lora.rank > 0,
rollout.engine=vllm). vLLM serves the base model from the checkpoint; each weight update's adapter
is written as PEFT's directory (`tandem.model.peft_format`) and added to vLLM as a LoRA adapter of
its own name and int id, and the previous one is removed, so one adapter is held at a time.

Why a directory: vLLM 0.32 loads an adapter only from a path (`LoRARequest.lora_path` must be
set, and `WorkerLoRAManager._load_adapter` reads adapter_config.json and adapter_model.safetensors
from it); the in-memory route (`LoRAModel.from_lora_tensors`) is reachable only by replacing vLLM's
worker-side loader, which verl patches and tandem would rather not. An adapter is ~1% of the model,
so writing it is cheap next to the push that brought it.
"""

import itertools
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tandem.config.schema import LoraConfig
from tandem.model.config import ModelConfig
from tandem.model.decoder import meta_model
from tandem.model.lora import adapter_names, apply_lora
from tandem.model.peft_format import save_adapter


class VllmAdapter:
    """The update buffers of a LoRA run's adapter and the vLLM adapter made from them.

    buffers: the trainer's adapter tensors by its names (`tandem.model.lora.adapter_names`:
        `...q_proj.lora_A.weight` (r, in), `...q_proj.lora_B.weight` (out, r)), in `dtype` on
        `device`; zeros until the first update. A fresh adapter (B = 0) is the base model whatever
        A holds, so until then requests carry no adapter and vLLM serves the base.
    request: the `vllm.lora.request.LoRARequest` of the adapter vLLM serves now; None before the
        first update.
    """

    def __init__(self, model_path: str | Path, lora: LoraConfig, dtype: torch.dtype, device: torch.device):
        self.base_path = str(Path(model_path).resolve())
        model = meta_model(ModelConfig.load(model_path))  # names, shapes, the PEFT config: no weight
        self.model = apply_lora(model, lora)
        shapes = dict(self.model.named_parameters())
        self.buffers: dict[str, Tensor] = {
            name: torch.zeros(shapes[name].shape, dtype=dtype, device=device)
            for name in adapter_names(self.model)
        }
        self.request: Any = None
        self._ids = itertools.count(1)  # vLLM's lora_int_id: > 0, never reused

    def load_into(self, llm: Any) -> None:
        """Write the buffers as a PEFT adapter, add it to vLLM's `LLMEngine` `llm` under a new name
        and id, and remove the one before it: requests submitted from now on carry `request`. Call
        it with no request of the old adapter running.

        The directory is deleted once vLLM has read it: vLLM keeps an added adapter in its CPU-side
        cache (room for two: `vllm_lora_args`) and reads the path again only for one it evicted,
        which holding one adapter never does (it would fail loudly, the path gone); a rollout
        actor that Ray kills leaves no directory behind."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)
        with tempfile.TemporaryDirectory(prefix="tandem-vllm-lora-") as tmp:
            path = Path(tmp) / f"adapter-{lora_id}"
            save_adapter(self.model, path, self.base_path, self.buffers)
            request = LoRARequest(f"tandem-lora-{lora_id}", lora_id, str(path))
            if not llm.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter {path}")
        old, self.request = self.request, request
        if old is not None:
            llm.remove_lora(old.lora_int_id)
        if llm.list_loras() != {lora_id}:  # what keeps memory from growing with every version
            raise RuntimeError(f"vLLM holds adapters {llm.list_loras()} after loading only {lora_id}")
