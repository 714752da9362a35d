"""LoRA adapters on tandem's decoder, trained in place of its weights (`peft_format` saves them).

`apply_lora` turns each targeted projection into a `LoraLinear`:

    y = x Wᵀ + b + s · B(A(dropout(x))),   A (r, in), B (out, r), s = alpha / r

W and b are the projection's own parameters, frozen, under their own names (`...q_proj.weight`); A
and B train and are named `...q_proj.lora_A.weight`, `...q_proj.lora_B.weight`: PEFT's saved names
less its `base_model.model.` prefix, so weight sync, checkpoints and PEFT speak one naming. A starts
as PEFT's does (Kaiming-uniform), B at zero, so a fresh adapter computes the base model exactly.
`modules_to_save` modules (an untied lm_head) train whole, under their own names.

The base stays one copy: `adapters_off` makes the same model compute the base policy, which is the
KL term's reference (verl and TRL do the same with PEFT's `disable_adapter`).

An MoE block's router and experts get no adapter: Hugging Face (transformers >= 5) stores a layer's
experts as fused 3-D tensors, which PEFT's target_modules cannot reach, so such an adapter could
not be loaded anywhere else. The batch-invariant forward and fused projections (the engines') read
the weights directly, past the adapters: `apply_lora` refuses such a model, `merge_lora` makes one.
The batch-invariant forward (run.deterministic) multiplies by each adapted linear's merged weight,
`LoraLinear.merged_weight`: W + s · B @ A in fp32, rounded once, differentiable in A and B, the
same bits an engine merges into its copy of the base (`merged`), so the behaviour logprobs equal
the trainer's exactly with an adapter as without. Adapter dropout has no merged form: refused there.
That is `tandem train`'s form (`MergedAdapters` merges on its engine). `tandem serve`'s engine runs
rows of several adapters unmerged beside the base (`tandem.model.row_adapters`), so its trainer
takes the unmerged form (`set_lora_form`): the batch-invariant forward multiplies by W and adds
s · (x Aᵀ) Bᵀ as the engine adds a row's, by the same function, in the same order.
"""

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.config.schema import LORA_ALL_LINEAR, LoraConfig
from tandem.errors import TandemError
from tandem.model import batch_invariant as bi
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, meta_model
from tandem.model.experts import SparseMoE
from tandem.model.row_adapters import side_by_side

LORA_FORMS = ("merged", "unmerged")
HEAD_WEIGHT, EMBED_WEIGHT = "lm_head.weight", "model.embed_tokens.weight"


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable low-rank update (the module docstring's formula), computed as
    PEFT computes it; `enabled=False` (`adapters_off`) leaves the frozen linear alone."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)
        self.register_parameter("bias", None if base.bias is None else base.bias.requires_grad_(False))
        a = initial_a(rank, self.in_features, generator)
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        self.lora_A = _bias_free(a.to(**like))
        self.lora_B = _bias_free(torch.zeros(self.out_features, rank, **like))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.enabled = True
        self.unmerged = False  # set_lora_form: the batch-invariant forward adds the adapter apart

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def merged_weight(self) -> Tensor:
        """The weight the batch-invariant forward multiplies by: W + s · B @ A computed as `merged`
        computes it (the engines' merge, bit for bit), rounded once to W's dtype, with gradients to
        A and B; W itself with the adapter off or in the unmerged form (`set_lora_form`)."""
        if not self.enabled or self.unmerged:
            return self.weight
        product = bi.linear(self.lora_B.weight.float(), self.lora_A.weight.float().t())  # B @ A
        return (product * self.scaling + self.weight.float()).to(self.weight.dtype)


class LoraDeltas:
    """The unmerged form's `low_rank` hook on an attention or MLP (`set_lora_form`): its adapted
    projections' s · (x Aᵀ) Bᵀ side by side (`side_by_side`, as `RowLora` computes a row's), added
    to the base's output. Called in the batch-invariant forward only (elsewhere each `LoraLinear`
    adds its own, PEFT's way)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x: Tensor, out: Tensor, names: tuple[str, ...]) -> Tensor:
        linears = [getattr(self.module, n) for n in names]
        on = [isinstance(lin, LoraLinear) and lin.enabled for lin in linears]
        parts = [
            (lin.lora_A.weight, lin.lora_B.weight) if o else None for lin, o in zip(linears, on, strict=True)
        ]
        if not any(on):
            return out
        scaling = next(lin.scaling for lin, o in zip(linears, on, strict=True) if o)
        widths = [lin.out_features for lin in linears]
        return out + side_by_side(x, parts, widths, scaling, self.module.batch_invariant)


def set_lora_form(model: CausalLM, form: str) -> None:
    """How `model`'s batch-invariant forward computes its adapters: "merged" (the default,
    `tandem train`'s: x (W + s · B @ A)ᵀ, `LoraLinear.merged_weight`) or "unmerged" (`tandem
    serve`'s: x Wᵀ + s · (x Aᵀ) Bᵀ, as its engine computes rows of several adapters). Outside that
    mode each `LoraLinear` computes PEFT's form either way. In place."""
    if form not in LORA_FORMS:
        raise ValueError(f"form={form!r}; valid: {', '.join(LORA_FORMS)}")
    unmerged = form == "unmerged"
    for _, m in lora_modules(model):
        m.unmerged = unmerged
    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            if hasattr(module, "low_rank") and any(isinstance(c, LoraLinear) for c in module.children()):
                module.low_rank = LoraDeltas(module) if unmerged else None


def initial_a(rank: int, in_features: int, generator: torch.Generator) -> Tensor:
    """A fresh adapter's A: kaiming_uniform_(a=√5), PEFT's default, drawn from `generator`."""
    bound = 1 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)


def fresh_adapters(model: CausalLM, seed: int) -> dict[str, Tensor]:
    """The values `apply_lora(model, ..., seed)` gives `model`'s adapters, for a model that has
    them: each A drawn as it draws them, in the same order from the same seed, each B zero ->
    {parameter name: value}. A new adapter on a model that already trains one (`tandem serve`'s
    next client)."""
    generator = torch.Generator().manual_seed(seed)
    fresh = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            a, b = module.lora_A.weight, module.lora_B.weight
            fresh[f"{name}.lora_A.weight"] = initial_a(a.shape[0], a.shape[1], generator).to(a)
            fresh[f"{name}.lora_B.weight"] = torch.zeros_like(b)
    return fresh


def _bias_free(weight: Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding `weight` (out, in), drawing no initial values of its own."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight)
    return linear


@dataclass
class Adapters:
    """What `apply_lora` did to a model: its config, the linears it adapted, the modules it trains whole."""

    config: LoraConfig
    targets: list[str]
    saved: list[str]


def apply_lora(model: CausalLM, lora: LoraConfig, seed: int = 0) -> CausalLM:
    """Freeze `model` and give each linear `lora.target_modules` names an adapter of `lora.rank`
    (A drawn from `seed`); `lora.modules_to_save` train whole. In place; returns `model`.
    TandemError for targets `lora_targets` refuses, a model with adapters already, or one whose
    forward would pass them by (fused projections)."""
    if getattr(model, "adapters", None) is not None:
        raise TandemError("The model has LoRA adapters already; apply_lora once.")
    if lora.rank < 1:
        raise TandemError(f"LoRA adapters need a rank >= 1, got {lora.rank} (train.lora.rank=0 is off).")
    if any(layer.self_attn.fused is not None for layer in model.model.layers):
        raise TandemError(
            "LoRA adapters cannot go on a model that runs fused projections: it multiplies the "
            "projections' weights directly, past the adapters."
        )
    targets = lora_targets(model, lora)
    saved = saved_modules(model, lora, targets)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name in targets:
        owner, _, child = name.rpartition(".")
        parent = model.get_submodule(owner)
        setattr(
            parent, child, LoraLinear(getattr(parent, child), lora.rank, lora.alpha, lora.dropout, generator)
        )
    for name in saved:
        model.get_submodule(name).requires_grad_(True)
    model.adapters = Adapters(lora, targets, saved)
    return model


def lora_targets(model: CausalLM, lora: LoraConfig) -> list[str]:
    """The names of the linears `lora.target_modules` selects, in model order: a module whose name
    is a target or ends in "." + one (PEFT's rule for a list; `lm_head` adapts the LM head, tied to
    the embedding or not: Tinker's train_unembed), or every linear of the decoder layers that can
    have an adapter (all-linear, PEFT's: not the head). TandemError naming the target for one that
    matches no linear, or matches an MoE block's router or experts."""
    moe = [f"{n}." for n, m in model.named_modules() if isinstance(m, SparseMoE)]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    eligible = [n for n in linears if not n.startswith(tuple(moe))]
    if lora.target_modules == LORA_ALL_LINEAR:
        return [n for n in eligible if n != "lm_head"]
    if isinstance(lora.target_modules, str):
        raise TandemError(
            f"train.lora.target_modules is {lora.target_modules!r}: a list, or {LORA_ALL_LINEAR}."
        )
    names = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in eligible))
    for target in lora.target_modules:
        matched = [n for n in linears if n == target or n.endswith(f".{target}")]
        if not matched:
            raise TandemError(
                f"Config 'train.lora.target_modules' names {target!r}, which matches no linear layer of "
                f"the model. Its linear layers that take an adapter: {names} (a name, or a dotted "
                f"suffix of one such as self_attn.q_proj), or {LORA_ALL_LINEAR} for all of them."
            )
        if inside := [n for n in matched if n.startswith(tuple(moe))]:
            raise TandemError(
                f"Config 'train.lora.target_modules' names {target!r}, which matches {inside[0]}, in an "
                "MoE block: LoRA on an MoE block's router and experts is not supported (Hugging Face "
                "stores a layer's experts as fused 3-D tensors, which PEFT's adapters cannot reach). "
                f"Name the projections of attention and of the dense layers' MLPs ({names}), or "
                f"{LORA_ALL_LINEAR}, which takes every one of them."
            )
    return [n for n in eligible if any(n == t or n.endswith(f".{t}") for t in lora.target_modules)]


def saved_modules(model: CausalLM, lora: LoraConfig, targets: list[str]) -> list[str]:
    """The modules `lora.modules_to_save` selects (PEFT's rule: a name that ends with one), to train
    whole. TandemError for one that matches nothing, holds an adapted linear, or shares a weight
    with a module outside it (a tied LM head: PEFT would load the two apart)."""
    modules = [n for n, _ in model.named_modules() if n]
    chosen = []
    for target in lora.modules_to_save:
        matched = [n for n in modules if n.endswith(target)]
        if not matched:
            top = ", ".join(n for n in modules if n.count(".") <= 1 and ".layers" not in n)
            raise TandemError(
                f"Config 'train.lora.modules_to_save' names {target!r}, which matches no module of the "
                f"model (its top-level modules: {top})."
            )
        for name in matched:
            if clash := [t for t in targets if t == name or t.startswith(f"{name}.")]:
                raise TandemError(
                    f"Config 'train.lora.modules_to_save' names {target!r}, which holds {clash[0]}, a "
                    "train.lora.target_modules linear: a module trains whole or gets an adapter, not both."
                )
            _refuse_tied(model, name)
        chosen += [n for n in matched if n not in chosen]
    return chosen


def _refuse_tied(model: nn.Module, module: str) -> None:
    inside = {id(p) for p in model.get_submodule(module).parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in inside and not name.startswith(f"{module}."):
            raise TandemError(
                f"Config 'train.lora.modules_to_save' names {module}, whose weight is tied to {name} "
                "(tie_word_embeddings): training it whole would train both, which PEFT would load as two "
                "different weights. Leave it out, or use a checkpoint whose head is untied."
            )


def check_lora(lora: LoraConfig, path: Path) -> None:
    """What `apply_lora` would refuse on model.path's checkpoint, checked in the driver before any
    actor starts, on a model of meta tensors."""
    model = meta_model(ModelConfig.load(path))
    saved_modules(model, lora, lora_targets(model, lora))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """(name, module) of every adapted linear, in model order."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear))


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "adapters", None) is not None


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block, `model` computes its base policy: every adapter is skipped. Modules trained
    whole (modules_to_save) keep no original to turn back to: refused."""
    adapters = getattr(model, "adapters", None)
    if adapters is not None and adapters.saved:
        raise TandemError(
            f"adapters_off: {adapters.saved} are trained whole and have no base to turn back to."
        )
    modules = [m for _, m in lora_modules(model)]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.enabled = True


def adapter_names(model: CausalLM) -> list[str]:
    """The names of the tensors that train, as `named_parameters` gives them, in its order: each
    adapter's lora_A and lora_B, and the parameters of the modules trained whole. An adapter-only
    weight push carries these."""
    own, saved = _low_rank_names(model), tuple(f"{n}." for n in model.adapters.saved)
    return [n for n, _ in model.named_parameters() if n in own or n.startswith(saved)]


def _low_rank_names(model: nn.Module) -> set[str]:
    """The names of every adapter's A and B."""
    return {f"{n}.{ab}.weight" for n, _ in lora_modules(model) for ab in ("lora_A", "lora_B")}


def base_weights(model: CausalLM, tensors: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Every weight but the adapters' A and B, as the model holds it (modules trained whole as
    trained): the Hugging Face checkpoint that, with the adapter beside it, is the policy."""
    tensors = dict(model.named_parameters()) if tensors is None else tensors
    low_rank = _low_rank_names(model)
    return {n: t for n, t in tensors.items() if n not in low_rank}


def head_of_its_own(tensors: dict[str, Tensor]) -> None:
    """Weights by name where a tied head is named once, as the embedding: an adapter on the head
    makes it a weight of its own, `lm_head.weight`, from the embedding's values. In place."""
    if HEAD_WEIGHT not in tensors and EMBED_WEIGHT in tensors:
        tensors[HEAD_WEIGHT] = tensors[EMBED_WEIGHT]


def merged(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """weight (out, in), a (r, in), b (out, r) -> W + s · B @ A (out, in) in fp32. The one formula
    every merge uses (exports, the engines' merged adapters, the deterministic trainer's
    `LoraLinear.merged_weight`), so they agree bit for bit: B @ A by the batch-invariant tiled
    matmul (one call shape in every process), then in place on the product, as W.float() + s · (B @ A)
    rounds, with no fp32 copy of W."""
    product = bi.tiled_mm(b.detach().float(), a.detach().float().t())
    return product.mul_(scaling).add_(weight.detach()).contiguous()


def merged_weights(model: CausalLM, tensors: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The base model's weights by name, each adapted one merged, W + s · B @ A, all in fp32 (an
    adapted head tied to the embedding as a weight of its own): a Hugging Face checkpoint of the
    policy. `tensors`: the weights by name when the model's own are
    shards (fsdp2 gathers them first)."""
    tensors = dict(model.named_parameters()) if tensors is None else tensors
    scaling = {n: m.scaling for n, m in lora_modules(model)}
    base = base_weights(model, tensors)
    if "lm_head" in scaling:
        head_of_its_own(base)
    out = {}
    for name, t in base.items():
        module = name.rpartition(".")[0]
        if module in scaling and name.endswith(".weight"):
            a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
            out[name] = merged(t, a, b, scaling[module])
        else:
            out[name] = t.detach().float()
    return out


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor an adapter-only weight push carries (`adapter_names`: each
    adapter's A and B, the parameters of `modules_to_save`), in the trainer's order, from the
    model's config alone: what a rollout worker plans its receive by, with no trainer at hand."""
    model = meta_model(cfg)
    apply_lora(model, lora)
    params = dict(model.named_parameters())
    return {n: tuple(params[n].shape) for n in adapter_names(model)}


@torch.no_grad()
def merge_lora(model: CausalLM) -> CausalLM:
    """Fold every adapter into its linear (W + s · B @ A, rounded once to W's dtype) and make the
    model a plain one again, every parameter trainable: what a full-weights export, the batch-
    invariant forward or fused projections need. In place; returns `model`."""
    for name, m in list(lora_modules(model)):
        weight = merged(m.weight, m.lora_A.weight, m.lora_B.weight, m.scaling)
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.to(m.weight.dtype))
        linear.bias = m.bias
        owner, _, child = name.rpartition(".")
        setattr(model.get_submodule(owner), child, linear)
    model.adapters = None
    return model.requires_grad_(True)
