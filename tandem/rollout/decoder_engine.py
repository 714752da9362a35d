"""What the built-in engines share: their copy of tandem's decoder (fused for inference, or its
linear weights in FP8; optionally compiled; a LoRA run's adapters merged into it), its sampling
generator, and the tensors sleeping frees."""

import itertools
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

from tandem.config.schema import LoraConfig
from tandem.errors import TandemError
from tandem.model.config import moe_layers
from tandem.model.decoder import CausalLM
from tandem.model.experts import Routing, routing
from tandem.model.fp8 import quantize_model, requantize
from tandem.model.fuse import fuse_projections
from tandem.model.gemv import gemv_backend
from tandem.model.packed import drop, pack_model, packed_bytes, packing_available, repack
from tandem.model.row_adapters import RowAdapters
from tandem.rollout.adapters import MergedAdapters
from tandem.rollout.base import RolloutEngine, Storages
from tandem.rollout.call import GenerateCall
from tandem.rollout.sequence import Sequence
from tandem.sample import Sample


class DecoderEngine(RolloutEngine):
    """An engine on `model`; `named_weights()` are its live parameters. `seed` seeds the generator
    that requests without a `Sample.seed` draw from; `compile`: see `BuiltinEngine`.

    quantization="fp8": the linear weights of attention and MLPs (experts included) multiply as
    float8 e4m3 in 128x128 blocks with `fp8_scale` scales (`tandem.model.fp8`); the parameters keep
    the pushed high-precision values by name and are quantised again after every update.
    pack (on the CPU, bf16 or fp32, not fp8 or compiled): the linear weights also kept packed for
    oneDNN, made again after every update (`tandem.model.packed`): faster matmuls from 3 rows on,
    for one more copy of the linear weights. None: in bf16 only.
    record_routing (an MoE model): every token's experts go to `Sample.routing` (routing replay).
    lora (rank > 0): a LoRA run's engine: `named_weights()` are the adapters (and modules_to_save),
    which pushes carry, merged into the weights after every update (`tandem.rollout.adapters`);
    or, after `load_adapters`, a table of several, each sample's applied to its rows unmerged.
    """

    def __init__(
        self,
        model: CausalLM,
        eos_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        version: int = 0,
        on_update: str = "drain",
        on_step: Callable[[int], None] | None = None,
        compile: bool = False,
        quantization: str = "none",
        fp8_scale: str = "fp32",
        pack: bool | None = None,
        record_routing: bool = False,
        lora: LoraConfig | None = None,
    ):
        super().__init__(eos_token_ids, version, on_update, on_step)
        self.moe_layers = moe_layers(model.cfg) if record_routing else []
        if record_routing and not self.moe_layers:
            raise ValueError("record_routing needs a mixture-of-experts model; this one has no experts")
        self.model = model.eval().requires_grad_(False)
        # Before fusing or quantising: the adapters copy the base weights of the plain projections.
        self.adapters = MergedAdapters(self.model, lora) if lora is not None and lora.rank else None
        self.quantized = quantization == "fp8"
        if self.quantized:  # each projection its own fp8 matmul (a fused weight would bypass them)
            quantize_model(self.model, fp8_scale)
        elif quantization == "none":  # one matmul for q/k/v and one for gate/up; the names stay
            fuse_projections(self.model)
        else:
            raise ValueError(f"quantization={quantization!r}; valid: none, fp8")
        if compile:  # decode steps through torch.compile
            check_compiler(self.model)
            self.model.compile_decode()
        dtype = self.model.lm_head.weight.dtype
        if pack is None:
            pack = dtype == torch.bfloat16
        self.packed = pack and not (compile or self.quantized) and packing_available(dtype, self.device)
        if self.packed:
            pack_model(self.model)
        self.pad_token_id = pad_token_id
        # On the model's device: a sampling draw must come from a generator of the noise's device.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.memory = Storages(self.weight_tensors())
        self._ids = itertools.count()
        self.row_table: RowAdapters | None = None  # the adapters samples may name (load_adapters)
        self._next_table: RowAdapters | None = None  # the table the update being applied brings

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def named_weights(self) -> dict[str, Tensor]:
        if self.adapters is not None:
            return self.adapters.tensors
        return dict(self.model.named_parameters())

    def weight_tensors(self) -> list[Tensor]:
        """The weights' tensors that sleep frees: all of them, or with LoRA what an update rewrites
        (`MergedAdapters.rewritten`; the base stays)."""
        if self.adapters is not None:
            return self.adapters.rewritten()
        return list(model_tensors(self.model))

    def forward(self, *args) -> tuple[Tensor, Tensor | None]:
        """The model's forward (its arguments: input_ids (B, T), ...) -> (logits, the experts each of
        its (B, T) tokens used, (B, T, L, k) int16, or None when the engine does not record routing).
        A forward of one or two tokens runs its matmuls on the CPU's faster matrix-vector kernel
        (`tandem.model.gemv`), outside the batch-invariant mode."""
        dtype, rows = self.model.lm_head.weight.dtype, args[0].numel()
        with nullcontext() if self.model.batch_invariant else gemv_backend(rows, dtype, self.device):
            if not self.moe_layers:
                return self.model(*args), None
            with routing(self.model, Routing(record=True)) as trace:
                logits = self.model(*args)
        return logits, trace.table().view(*args[0].shape[:2], len(self.moe_layers), -1)  # input_ids' (B, T)

    def sequences(self, samples: list[Sample], call: GenerateCall) -> list[Sequence]:
        """The call's samples as `Sequence`s (ids unique over the engine's life); recording routing,
        each with an empty record of its experts, (max_tokens, L, k) of -1."""
        named = {s.adapter for s in samples} - {None}
        held = set(self.row_table.names) if self.row_table is not None else set()
        if named - held:
            raise ValueError(
                f"samples name the adapters {sorted(named - held)}, which the engine does not hold "
                f"(load_adapters; it holds {sorted(held)})"
            )
        seqs = [Sequence.start(next(self._ids), s, call.cap(s)) for s in samples]
        if self.moe_layers:
            for seq in seqs:
                shape = (seq.max_tokens, len(self.moe_layers), self.model.cfg.num_experts_per_tok)
                seq.routes = torch.full(shape, -1, dtype=torch.int16)
        return seqs

    def load_adapters(self, named: Mapping[str, Mapping[str, Tensor]], version: int) -> None:
        """While idle: from now on serve `version`: the base's weights, no adapter merged, and a table
        of `named`'s adapters (name -> its tensors as a push carries them, `named_weights()`'s
        names), so that each sample of a later call may name one (`Sample.adapter`) and its rows
        take that adapter unmerged (`tandem.model.row_adapters`; None: the base). Any later update
        drops the table. TandemError for an engine that cannot: not a LoRA run's, FP8 (its
        projections are not fused), or with modules_to_save."""
        if self.adapters is None or self.quantized:
            raise TandemError(
                "Rows of several adapters in one call need a LoRA run's built-in engine (train.lora.rank "
                "> 0) with fused projections (rollout.quantization=none)."
            )
        table = self.adapters.table(named)

        def apply() -> None:
            self._next_table = table

        self.set_pending_update(version, apply)
        self.apply_pending()

    def adapter_rows(self, names: list[str | None]) -> AbstractContextManager:
        """Within this context a forward adds to batch row b the adapter names[b] of the table
        (`Sample.adapter`; None: none); nothing when no row names one."""
        if all(n is None for n in names):
            return nullcontext()
        index = self.row_table.index
        return self.row_table.use(self.model, [-1 if n is None else index[n] for n in names])

    def _after_update(self) -> None:
        self.row_table, self._next_table = self._next_table, None
        if self.adapters is not None and self.row_table is not None:
            self.adapters.unmerge()
        elif self.adapters is not None:
            self.adapters.merge()
        if self.quantized:  # from the merged weights
            requantize(self.model)
        if self.packed:
            repack(self.model)

    def _on_sleep(self) -> None:
        drop(self.model)  # made again from the weights after the update that wakes the engine

    def engine_bytes(self) -> int:
        return super().engine_bytes() + packed_bytes(self.model)

    def rng_state(self) -> Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: Tensor) -> None:
        self.generator.set_state(state)


def model_tensors(model: CausalLM) -> Iterator[Tensor]:
    """Every tensor of the weights: parameters, buffers (an fp8 copy) and the fused projections
    (they share the parameters' storage)."""
    yield from model.parameters()
    yield from model.buffers()
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
