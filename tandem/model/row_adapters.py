"""Rows of different LoRA adapters in one forward, each row's adapter applied unmerged beside the
shared base weights:

    y_row = x_row W0ᵀ (+ b) + s · (x_row A_iᵀ) B_iᵀ      for the row's adapter i (s = alpha / r)

W0 is what the model multiplies by already (an engine's fused q|k|v and gate|up weights, packed or
not), untouched. `RowAdapters` holds a table of adapters of one shape, each as a push carries it
(`<projection>.lora_A.weight`, `.lora_B.weight`). For one forward, `RowAdapters.use(model, rows)`
says which adapter each batch row takes (an index into the table; -1: none, the base) and gives
each attention and dense MLP of the model a `low_rank` hook (`RowLora`), which the decoder calls
after each adapted matmul with its input and output (`tandem.model.decoder`), and the model one for
its head (`head_low_rank`) when the adapters adapt it. Per adapter, the hook
gathers that adapter's rows, computes their delta (`low_rank`: two thin matmuls per projection)
and adds it into those rows; a fused output's delta is its projections' deltas side by side (zeros
for a projection without an adapter). Rows of no adapter get nothing; a forward whose rows all
take none runs with no hook at all, the base's own path.

In the batch-invariant mode the two matmuls are `bi.linear`'s, whose rows do not depend on the
others: the trainer's unmerged form (`tandem.model.lora.set_lora_form`) computes each row's delta
by the same function on its rows and adds it to the same base output in the same order, so an
engine row's logits equal its own trainer's bit for bit whatever the other rows' adapters.
"""

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.model import batch_invariant as bi

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"

# The decoder's hook: (the matmul's input (..., in), its output (..., N): the named projections'
# outputs side by side, the projections' names) -> the output with the adapters' deltas added.
LowRank = Callable[[Tensor, Tensor, tuple[str, ...]], Tensor]


def low_rank(x: Tensor, a: Tensor, b: Tensor, scaling: float, invariant: bool) -> Tensor:
    """x (..., in), a (r, in), b (out, r) -> s · (x Aᵀ) Bᵀ (..., out), by the batch-invariant
    matmuls when `invariant` (the engine's rows and the trainer's unmerged form alike)."""
    a, b = a.to(x.dtype), b.to(x.dtype)
    if invariant:
        return bi.linear(bi.linear(x, a), b) * scaling
    return F.linear(F.linear(x, a), b) * scaling


def side_by_side(
    x: Tensor, parts: list[tuple[Tensor, Tensor] | None], widths: list[int], scaling: float, invariant: bool
) -> Tensor | None:
    """The deltas of projections that read the same x, concatenated along the last dim (part i:
    (A, B), or None for a projection of widths[i] outputs without an adapter, which adds zeros)
    -> (..., sum(widths)); None when no part has an adapter."""
    if all(p is None for p in parts):
        return None
    outs = [
        x.new_zeros(*x.shape[:-1], w) if p is None else low_rank(x, *p, scaling, invariant)
        for p, w in zip(parts, widths, strict=True)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class RowAdapters:
    """A table of adapters of one shape, by name, for forwards whose rows take different ones.

    named: adapter name -> its tensors by push name (A (r, in) and B (out, r) of each of `targets`,
        the adapted projections' module names); scaling: alpha / r.
    """

    def __init__(self, named: Mapping[str, Mapping[str, Tensor]], targets: list[str], scaling: float):
        self.names = list(named)
        self.index = {name: i for i, name in enumerate(self.names)}
        targets = targets if self.names else []  # an empty table: every row the base's
        self.a = {t: torch.stack([named[n][t + LORA_A] for n in self.names]) for t in targets}  # (n, r, in)
        self.b = {t: torch.stack([named[n][t + LORA_B] for n in self.names]) for t in targets}  # (n, out, r)
        self.scaling = scaling
        self.groups: list[tuple[int, Tensor]] = []  # (adapter, its batch rows) of the running forward
        self.batch = 0  # batch rows of the running forward
        self._tokens: dict[int, list[tuple[int, Tensor]]] = {}  # tokens a row -> groups of token rows

    def __len__(self) -> int:
        return len(self.names)

    def token_groups(self, tokens: int) -> list[tuple[int, Tensor]]:
        """(adapter, its token rows) of a (batch · T, ...) tensor, T = tokens // batch: batch row b's
        tokens are rows b·T .. b·T + T - 1."""
        if tokens not in self._tokens:
            t = tokens // self.batch
            self._tokens[tokens] = [
                (i, (rows[:, None] * t + torch.arange(t, device=rows.device)).flatten())
                for i, rows in self.groups
            ]
        return self._tokens[tokens]

    @contextmanager
    def use(self, model: nn.Module, rows: list[int]) -> Iterator[None]:
        """Within the block, `model`'s forward adds to batch row b the delta of adapter rows[b]
        (-1: none). A `CausalLM` whose projections are fused (an engine's: the hook reads no
        `LoraLinear`)."""
        by: dict[int, list[int]] = {}
        for r, i in enumerate(rows):
            if i >= 0:
                by.setdefault(i, []).append(r)
        if not by:  # the base's rows alone: the base's path, no hook
            yield
            return
        device = model.lm_head.weight.device
        self.batch, self._tokens = len(rows), {}
        self.groups = [(i, torch.tensor(r, device=device)) for i, r in sorted(by.items())]
        hooked = []
        for n, layer in enumerate(model.model.layers):
            for kind, module in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                if hasattr(module, "low_rank"):  # attention and dense MLPs; experts take none
                    module.low_rank = RowLora(self, module, f"model.layers.{n}.{kind}.")
                    hooked.append(module)
        model.row_adapters = self
        if "lm_head" in self.a:  # adapters of the LM head (Tinker's train_unembed)
            model.head_low_rank = RowLora(self, model, "")
        try:
            yield
        finally:
            for module in hooked:
                module.low_rank = None
            model.row_adapters, model.head_low_rank, self.groups = None, None, []


class RowLora:
    """The `LowRank` hook of one attention or MLP (`module`, its name and a dot `prefix`), or of the
    model's head (the model, prefix ""), in a forward that `RowAdapters.use` set up: each adapter's
    rows get its delta."""

    def __init__(self, table: RowAdapters, module: nn.Module, prefix: str):
        self.table, self.module, self.prefix = table, module, prefix

    def __call__(self, x: Tensor, out: Tensor, names: tuple[str, ...]) -> Tensor:
        table = self.table
        x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])  # token rows
        if torch.is_grad_enabled():  # in place below: never into a tensor autograd saved
            out2 = out2.clone()
        targets = [self.prefix + n for n in names]
        widths = [getattr(self.module, n).out_features for n in names]
        invariant = self.module.batch_invariant
        for i, rows in table.token_groups(x2.shape[0]):
            parts = [(table.a[t][i], table.b[t][i]) if t in table.a else None for t in targets]
            delta = side_by_side(x2[rows], parts, widths, table.scaling, invariant)
            if delta is not None:
                out2.index_copy_(0, rows, out2[rows] + delta)
        return out2.reshape(out.shape)
