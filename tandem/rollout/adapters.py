"""A LoRA run's adapters in the built-in engines: pushes carry the adapters only, merged on arrival.

With train.lora.rank > 0 a weight push carries what trains, `adapter_names` of the trainer's model
(each adapter's A and B, the parameters of `modules_to_save`), in its order; `MergedAdapters`
gives the engine tensors of those names and shapes (`adapter_shapes`, from the model's config and
train.lora alone), so the rollout side plans the same bytes without a trainer. The staging buffer
swaps a version into them as it swaps full weights, so `rollout.on_update` (drain, abort,
continue) means what it means for full pushes; then the engine's `_after_update` merges:

    W = W0 + (alpha / r) · B @ A     in fp32 (`tandem.model.lora.merged`), rounded once to W's dtype

for every adapted projection, W0 a copy of its base weight kept on the engine's device. A
`modules_to_save` parameter is written by the swap itself. Written in place, into the same
tensors: the fused q|k|v and gate|up matmuls (`fuse_projections`: the projections' weights are
views of them), an FP8 engine's requantisation, compiled decode steps and CUDA graphs all see the
new weights with nothing rebuilt.

Merged, not unmerged (x Wᵀ + s · (x Aᵀ) Bᵀ at every projection of every decode step).
`python bench/lora.py` measured both side by side, decode tokens/s at batch 8, rank 16 on attention
+ MLP, fp32, against the engine on the base (AMD EPYC, 2 cores shared; the unmerged form is PEFT's
layer, `LoraLinear`, which needs the projections unfused, so the unfused base is measured too):

    model                        merged / base   unmerged / base   unfused base / base
    builtin:addition                  1.03             0.71               0.91
    Qwen2-0.5B-shaped (494M)          1.00             1.20               1.28

Merged, a decode step is the base model's step: same matmuls, nothing added, whatever path the
engine runs (fused, FP8, compiled, CUDA graphs). Unmerged adds two thin matmuls per projection per
step, 22% of the unfused base's rate on the small model, where steps are bound by launches, 6% on
the 0.5B one (1.20 / 1.28; a fused form of it would add the same matmuls). Merging costs once
per update instead: one (out × r)·(r × in) product and a pass over each adapted weight, ~0.8 s
for the 0.5B model on that CPU (0.85 s timed alone), nearly all of its adapter push (0.78 s, the
median of two; a full push took 8.2 s). The price is memory: W0, a copy of the adapted weights
(72% of the 0.5B model's parameters); a sleeping engine frees the merged copy and keeps W0
(`rewritten`): an adapter push cannot bring the base back.

Merged, `run.deterministic` keeps mismatch exactly 0: the trainer's batch-invariant forward
multiplies by the same merged weight (`LoraLinear.merged_weight`, `merged`'s bits). Otherwise, in
bf16 the merged weight is rounded once where the trainer rounds the base's and the adapter's
products apart: the behaviour logprobs differ from the trainer's
recompute about as the bf16 engine's do without one (1.3 times as much on the tiny model of
tests/test_lora_sync.py); in fp32 to float error, as without an adapter.

Rows of several adapters in one call (`tandem serve`'s samplers): no merge can serve them, so
`DecoderEngine.load_adapters` brings a table of adapters (`table`: `RowAdapters`) and the base's
weights back into the projections (`unmerge`: W0, then requantised and repacked as after a
merge), and each sample's rows add their adapter unmerged at every adapted projection,
x W0ᵀ + s · (x Aᵀ) Bᵀ (`tandem.model.row_adapters`), the cost measured above for the unmerged form
(not measured for the table itself). Any later update drops the table. A `modules_to_save`
parameter replaces the base's module for every row, so such adapters are refused a table (the
service runs one call per adapter for them). In `run.deterministic` the trainer then computes the
same unmerged form (`tandem.model.lora.set_lora_form`), so the rows' logprobs equal it exactly.
"""

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from tandem.config.schema import LoraConfig
from tandem.errors import TandemError
from tandem.model.decoder import CausalLM
from tandem.model.fp8 import Fp8Linear
from tandem.model.lora import adapter_shapes, merged
from tandem.model.row_adapters import LORA_A, LORA_B, RowAdapters


class MergedAdapters:
    """The adapters of a LoRA run on an engine's `model` (given before the engine fuses or
    quantises it, its weights the base's).

    tensors: by name, in push order, what the engine's `named_weights()` returns: a zero A and B
        per adapter (so version 0 serves the base, as the trainer's fresh adapters compute it), and
        the model's own parameters of `modules_to_save`.
    """

    def __init__(self, model: CausalLM, lora: LoraConfig):
        self.model, self.scaling = model, lora.alpha / lora.rank
        like = dict(dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device)
        params = dict(model.named_parameters())
        shapes = adapter_shapes(model.cfg, lora)
        self.tensors = {n: params[n] if n in params else torch.zeros(s, **like) for n, s in shapes.items()}
        self.targets = [n.removesuffix(LORA_A) for n in shapes if n.endswith(LORA_A)]
        head = model.lm_head
        if "lm_head" in self.targets and head.weight is model.model.embed_tokens.weight:
            # a merge must not write into the embedding the head is tied to: a head of its own
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        self.base = {t: model.get_submodule(t).weight.detach().clone() for t in self.targets}

    def table(self, named: Mapping[str, Mapping[str, Tensor]]) -> RowAdapters:
        """Adapters of this run's shape, each by name as a push carries it, as a table for rows of
        several adapters in one call (served unmerged beside the base, `unmerge`). TandemError with
        `modules_to_save`: a module trained whole replaces the base's, which rows cannot mix."""
        saved = [n for n in self.tensors if not n.endswith((LORA_A, LORA_B))]
        if saved:
            raise TandemError(
                f"Rows of several adapters cannot share one engine call when the adapters train "
                f"{saved[0]} whole (train.lora.modules_to_save): run one call per adapter."
            )
        return RowAdapters(named, self.targets, self.scaling)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Every adapted projection's weight <- W0: the base, beside which a table's adapters run."""
        for t in self.targets:
            self.model.get_submodule(t).weight.copy_(self.base[t])

    @torch.no_grad()
    def merge(self) -> None:
        """Every adapted projection's weight <- W0 + s · B @ A, in place (after a push)."""
        for t in self.targets:
            a, b = self.tensors[t + LORA_A], self.tensors[t + LORA_B]
            self.model.get_submodule(t).weight.copy_(merged(self.base[t], a, b, self.scaling))

    def rewritten(self) -> list[Tensor]:
        """One tensor per storage that a push and `merge` write whole, all a sleeping engine may
        free: the adapters, the merged weights and modules_to_save (where no weight outside them
        shares the storage, as k_proj's shares q_proj's in a fused q|k|v), an FP8 engine's
        quantised copies. The rest, W0 included, stays: no adapter push brings it back."""
        model = self.model
        written = {f"{t}.weight" for t in self.targets} | set(self.tensors)
        for m, module in model.named_modules():
            if isinstance(module, Fp8Linear):  # requantised from its weight after every update
                written |= {f"{m}.qweight", f"{m}.scales"}
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        by_storage: dict[int, list[tuple[str, Tensor]]] = {}
        for name, t in [*named.items(), *((n, t) for n, t in self.tensors.items() if n not in named)]:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
        return [views[0][1] for views in by_storage.values() if all(n in written for n, _ in views)]
