"""The built-in engines' copy of tandem's decoder: fused for inference, optionally compiled, and
the tensors sleeping frees."""

import os
import shutil
from collections.abc import Iterator

from torch import Tensor

from tandem.errors import TandemError
from tandem.model import CausalLM, fuse_projections


def inference_model(model: CausalLM, compile: bool = False) -> CausalLM:
    """`model` in eval mode without gradients, with one matmul for q/k/v and one for gate/up per
    layer (parameters keep their names); `compile` runs its decode steps through torch.compile."""
    model = fuse_projections(model.eval().requires_grad_(False))
    if compile:
        check_compiler(model)
        model.compile_decode()
    return model


def model_tensors(model: CausalLM) -> Iterator[Tensor]:
    """Every tensor of the weights: parameters and the fused projections (they share storage)."""
    yield from model.parameters()
    for layer in model.model.layers:
        for fused in (layer.self_attn.fused, layer.mlp.fused):
            yield from (t for t in fused or () if t is not None)


def check_compiler(model: CausalLM) -> None:
    """torch.compile builds C++ for the CPU: fail now, clearly, rather than at the first decode."""
    if next(model.parameters()).device.type != "cpu":
        return
    names = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(name and shutil.which(name) for name in names):
        raise TandemError(
            "rollout.compile=true needs a C++ compiler on the CPU (torch.compile builds its kernels "
            "with one) and none was found (tried $CXX, g++, c++, clang++). Install one (Debian: "
            "apt install g++) or set rollout.compile=false."
        )
