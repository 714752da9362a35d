"""For inference: each decoder layer's q/k/v projections, and its gate/up projections, as one matmul.

Applied to a built `CausalLM` (the engines do, when they load a model), never woven into it: the
decoder only reads the `fused` tensors when they are there. Training never fuses.
"""

import torch
from torch import Tensor, nn

from tandem.errors import TandemError
from tandem.model.decoder import MLP, CausalLM


def fuse_projections(model: CausalLM) -> CausalLM:
    """For inference: each layer's q/k/v projections, and its gate/up projections, become one matmul.

    Their weights (and biases) are copied into one tensor per layer, and each projection's
    parameter becomes a view of its rows of it. Names, shapes and values stay as they were, so a
    weight update that copies into the parameters by Hugging Face name (the engines' weight sync)
    writes the fused tensor too. Replacing a parameter object (load_state_dict(assign=True),
    moving the model to another device) would break the link: fuse after the model is in place.
    Training never fuses, so gradients stay per projection. Fusing a fused model is a no-op (two
    engines may share one), except for a copy.deepcopy of one, whose parameters and fused tensors
    no longer share storage: it is fused again from its parameters. Returns `model`.
    """
    _refuse_adapters(model, "fuse_projections")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linked = attn.fused is not None and attn.fused[0].data_ptr() == attn.q_proj.weight.data_ptr()
        if not linked:
            attn.fused = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            if isinstance(mlp, MLP):  # experts run as they are
                mlp.fused = _fuse([mlp.gate_proj, mlp.up_proj])
    return model


def _refuse_adapters(model: nn.Module, what: str) -> None:
    """`what` multiplies the projections' weights itself, so it would pass a LoRA adapter by."""
    adapted = next((n for n, m in model.named_modules() if hasattr(m, "lora_A")), None)
    if adapted is not None:
        raise TandemError(
            f"{what} multiplies the projections' weights directly, past the LoRA adapter of {adapted}: "
            "merge the adapters first (tandem.model.lora.merge_lora)."
        )


def _fuse(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """Concatenate the linears' weights (and biases) row-wise; each parameter becomes a view of its rows."""
    fused: list[Tensor | None] = []
    for kind in ("weight", "bias"):
        parts = [getattr(lin, kind) for lin in linears]
        if parts[0] is None:
            fused.append(None)
            continue
        whole = torch.cat([p.detach() for p in parts])
        start = 0
        for lin, p in zip(linears, parts, strict=True):
            view = whole[start : start + p.shape[0]]
            setattr(lin, kind, nn.Parameter(view, requires_grad=p.requires_grad))
            start += p.shape[0]
        fused.append(whole)
    return fused[0], fused[1]
