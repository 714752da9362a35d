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
    own: dict[int, Tensor] = field(default_factory=dict)  # with `record` and `forced`: its own top-k

    def table(self) -> Tensor:
        """The recorded experts as one (N, L, k) int16 table, the MoE layers in order."""
        return torch.stack([self.chosen[i] for i in sorted(self.chosen)], dim=1).to(torch.int16)

    @classmethod
    def replay(cls, table: Tensor, model: nn.Module, record: bool = False) -> "Routing":
        """Force the experts of an (N, L, k) table (-1 rows route on their own) on the MoE layers
        of `model`, the table's L columns in layer order."""
        layers = sorted(m.layer for m in model.modules() if isinstance(m, SparseMoE))
        if table.shape[1] != len(layers):
            raise ValueError(f"a routing table of {table.shape[1]} MoE layers for a model with {len(layers)}")
        return cls({layer: table[:, j].long() for j, layer in enumerate(layers)}, record)


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
            if self.routing.record:
                self.routing.own[self.layer] = experts
            free = (forced < 0).any(-1, keepdim=True)  # (N, 1) rows with no recorded routing
            experts = torch.where(free, experts, forced.to(experts.device))
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
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self.every_expert(flat, experts)
        else:
            out = self.grouped(flat, experts)
        out = out * weights.to(out.dtype)[..., None]  # (N, k, E)
        combined = out[:, 0]
        for j in range(1, out.shape[1]):  # slot by slot: a fixed order, whatever the batch
            combined = combined + out[:, j]
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(flat, self.batch_invariant)
            gate = self.shared_expert_gate
            g = bi.linear(flat, gate.weight) if self.batch_invariant else gate(flat)
            combined = combined + torch.sigmoid(g) * shared
        return combined.view_as(x)

    def grouped(self, flat: Tensor, experts: Tensor) -> Tensor:
        """flat (N, E), experts (N, k) -> (N, k, E) each (token, slot)'s expert output: the pairs
        sorted by expert, each expert multiplying its own rows in one matmul."""
        n, k = experts.shape
        slots = experts.reshape(-1)  # (N·k,) the expert of each (token, slot)
        order = torch.sort(slots, stable=True).indices  # (token, slot) pairs grouped by expert
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        out = flat.new_empty(n * k, flat.shape[-1])
        # While gradients are on, an expert with no tokens still runs (on no rows), so every parameter
        # gets a gradient (zeros) on every rank: DDP fails on an unused one, and FSDP2 would
        # reduce-scatter the gradients of different experts on different ranks together.
        train = torch.is_grad_enabled()
        for expert, rows in zip(self.experts, order.split(counts), strict=True):
            if len(rows) or train:
                out[rows] = expert(flat[rows // k], self.batch_invariant)
        return out.view(n, k, -1)

    def every_expert(self, flat: Tensor, experts: Tensor) -> Tensor:
        """flat (N, E), experts (N, k) -> (N, k, E) as `grouped`, without its host sync (the token
        counts), which a CUDA graph cannot record: every expert runs on every token and each
        (token, slot) takes its expert's row. X/k times the FLOPs, for a recorded decode step's few rows."""
        every = torch.stack([expert(flat, self.batch_invariant) for expert in self.experts])  # (X, N, E)
        return every[experts, torch.arange(len(flat), device=flat.device)[:, None]]


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


def set_router_dtype(model: nn.Module, dtype: str) -> None:
    """model.router_dtype: every MoE layer's router in float32, or in the compute dtype ("model")."""
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.router_fp32 = dtype == "float32"


def agreement(engine: Tensor, trainer: Tensor) -> float:
    """engine, trainer (N, L, k) experts, -1 rows unknown -> the share of the known token-layer
    top-k sets that are equal (as sets: the order of the k slots does not count)."""
    known = (engine >= 0).all(-1)  # (N, L)
    same = (engine.sort(-1).values == trainer.to(engine.dtype).sort(-1).values).all(-1)
    return float(same[known].float().mean()) if known.any() else 1.0
