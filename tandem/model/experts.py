"""Mixture-of-experts feed-forward blocks (Qwen2-MoE, Qwen3-MoE, Mixtral) for the one decoder.

Module names mirror the checkpoints' (`mlp.gate`, `mlp.experts.3.up_proj`, Mixtral's
`block_sparse_moe.experts.3.w3`), so a checkpoint loads with no renaming and weight sync speaks
the same names. Experts run grouped: the (token, slot) pairs are sorted by expert and each expert
multiplies its own rows once. The combine gathers each token's k outputs back and adds them in slot
order, a fixed-order reduction (never an atomic `index_add_`/`scatter_add_`), so a token's output
is the same whatever else the batch routes where.

Routing replay: `Routing` records the experts each MoE layer chose for every token of a forward, or
makes the layers use given experts instead of their own top-k (the combine weights are then taken
from the router's own probabilities over those experts), docs/moe.md.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.model import batch_invariant as bi
from tandem.model.config import ModelConfig


@dataclass
class Routing:
    """One forward's routing, by MoE layer index. `forced[layer]` (N, k) long: the experts each of
    the forward's N = B·T tokens (in its (B, T) order) must use; a row with a -1 routes on its own.
    `chosen[layer]` (N, k): what each token used, filled when `record` is set."""

    forced: dict[int, Tensor] = field(default_factory=dict)
    record: bool = False
    chosen: dict[int, Tensor] = field(default_factory=dict)


class Expert(nn.Module):
    """One SiLU-gated MLP: down(silu(gate(x)) * up(x)), its linears named as the family names them."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names  # gate, up, down
        for name, shape in zip(names, ((inner, hidden), (inner, hidden), (hidden, inner)), strict=True):
            setattr(self, name, nn.Linear(shape[1], shape[0], bias=False))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)  # type: ignore[return-value]

    def forward(self, x: Tensor, batch_invariant: bool = False) -> Tensor:
        gate, up, down = self.linears()
        if batch_invariant:  # rows padded to a fixed tile: the expert's row count changes nothing
            return bi.mlp(x, torch.cat([gate.weight, up.weight]), None, down.weight, None)
        return down(F.silu(gate(x)) * up(x))


EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}  # else Qwen's gate_proj, up_proj, down_proj


class SparseMoE(nn.Module):
    """The routed experts of one layer (`layer`: its index), Qwen2-MoE's gated shared expert too.

    The router's logits, softmax and top-k run in fp32 (`cfg.router_dtype="float32"`) or in the
    compute dtype ("model"); ties go to the lower expert index. With `norm_topk_prob` (Mixtral:
    always) the k weights are renormalised to sum to 1.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.k = layer, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob or cfg.model_type == "mixtral"
        self.router_fp32 = cfg.router_dtype == "float32"
        h = cfg.hidden_size
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        names = EXPERT_NAMES.get(cfg.model_type, ("gate_proj", "up_proj", "down_proj"))
        self.experts = nn.ModuleList(
            Expert(h, cfg.moe_intermediate_size, names) for _ in range(cfg.num_experts)
        )
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Expert(h, cfg.shared_expert_intermediate_size, names)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.fused = None  # never fused (fuse_projections fuses dense MLPs only)
        self.batch_invariant = False  # set by CausalLM.batch_invariant
        self.routing: Routing | None = None  # set for one forward by `routing`

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, E) -> experts (N, k) long, their weights (N, k) fp32 (renormalised if the family
        does). Forced experts (`Routing.forced`) replace a row's own choice."""
        dtype = torch.float32 if self.router_fp32 else x.dtype
        weight = self.gate.weight.to(dtype)
        logits = bi.linear(x.to(dtype), weight) if self.batch_invariant else F.linear(x.to(dtype), weight)
        probs = logits.softmax(-1)  # (N, X) in the router dtype
        # A stable descending sort: among equal probabilities the lower expert index comes first.
        experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, : self.k]
        forced = self.routing.forced.get(self.layer) if self.routing is not None else None
        if forced is not None:
            own = (forced < 0).any(-1, keepdim=True)  # (N, 1) rows with no recorded routing
            experts = torch.where(own, experts, forced.to(experts.device))
        weights = probs.gather(-1, experts).float()
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routing is not None and self.routing.record:
            self.routing.chosen[self.layer] = experts
        return experts, weights

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, E) -> (B, T, E)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, E)
        experts, weights = self.route(flat)
        n, k = experts.shape
        slots = experts.reshape(-1)  # (N·k,) the expert of each (token, slot)
        order = torch.sort(slots, stable=True).indices  # (token, slot) pairs grouped by expert
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        out = flat.new_empty(n * k, flat.shape[-1])  # each (token, slot)'s expert output
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = order[start : start + count]
                out[rows] = expert(flat[rows // k], self.batch_invariant)
                start += count
        out = out.view(n, k, -1) * weights.to(out.dtype)[..., None]
        combined = out[:, 0]
        for j in range(1, k):  # slot by slot: a fixed order, whatever the batch
            combined = combined + out[:, j]
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(flat, self.batch_invariant)
            gate = self.shared_expert_gate
            g = bi.linear(flat, gate.weight) if self.batch_invariant else gate(flat)
            combined = combined + torch.sigmoid(g) * shared
        return combined.view_as(x)


class routing:  # noqa: N801 (a context manager, used like a function)
    """`with routing(model, Routing(...)):` every MoE layer of `model` routes under it for the
    forwards inside; `Routing.chosen` holds what they used afterwards (with `record`)."""

    def __init__(self, model: nn.Module, trace: Routing):
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.trace = trace

    def __enter__(self) -> Routing:
        for b in self.blocks:
            b.routing = self.trace
        return self.trace

    def __exit__(self, *exc) -> None:
        for b in self.blocks:
            b.routing = None


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the layers whose feed-forward is a `SparseMoE` (the rest are dense)."""
    if not cfg.num_experts:
        return []
    sparse = [(i + 1) % cfg.decoder_sparse_step == 0 for i in range(cfg.num_hidden_layers)]
    return [i for i, s in enumerate(sparse) if s and i not in cfg.mlp_only_layers]
