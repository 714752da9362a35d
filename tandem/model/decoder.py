"""The one decoder of the Llama / Qwen2 / Qwen3 family, used by the rollout engine AND the trainer.

Module names mirror Hugging Face's (`model.layers.0.self_attn.q_proj.weight` ...) so a checkpoint's
state dict loads with no renaming, and weight sync to any engine speaks the same names.
The engines' inference-only fusing of projections is applied to it (`tandem.model.fuse`).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.model import batch_invariant as bi
from tandem.model import packed
from tandem.model.config import ModelConfig, moe_layers
from tandem.model.experts import SparseMoE
from tandem.model.kv_cache import BatchCache, KVCache
from tandem.model.logprobs import Targets, score_tokens
from tandem.model.rope import apply_rope, check_positions, rope_table
from tandem.model.row_adapters import LowRank, low_rank
from tandem.model.segments import Segments

# The projections whose outputs one matmul gives side by side (what a `low_rank` hook is told)
QKV, OUT = ("q_proj", "k_proj", "v_proj"), ("o_proj",)
GATE_UP, DOWN = ("gate_proj", "up_proj"), ("down_proj",)
HEAD = ("lm_head",)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.batch_invariant = False  # set by CausalLM.batch_invariant

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            # The same product in one call (torch multiplies by the weight last): a third less time
            # for a decode step's rows. Not under autograd, whose backward would differ.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if x.dtype == self.weight.dtype and not torch.is_grad_enabled() and not self.batch_invariant:
            # bf16: the kernel normalises in fp32 and rounds once, then the weight multiplies, as
            # below, in two calls instead of four (an engine's forward). Outside the batch-invariant
            # mode, whose engine must run the trainer's very kernels.
            return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight
        # Normalise in fp32 whatever the weights' dtype, as Hugging Face does, so logits match.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fused: tuple[Tensor, Tensor | None] | None = None  # q|k|v weight, bias: fuse_projections
        self.packed: Tensor | None = None  # the fused weight for oneDNN: tandem.model.packed
        self.batch_invariant = False  # set by CausalLM.batch_invariant
        # Adds LoRA deltas after the batch-invariant or fused matmuls (never the unfused ones, where a
        # LoraLinear adds its own): an engine's rows of several adapters (tandem.model.row_adapters),
        # or a trainer's unmerged adapters in the batch-invariant mode (tandem.model.lora).
        self.low_rank: LowRank | None = None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | Segments,
        layer: int,
        cache: KVCache | BatchCache | None,
    ) -> Tensor:
        """x (B, T, E), mask (B, 1, T, S) additive float (0 or -inf) (one token, T = 1: already in
        `decode_bias`'s layout, outside the batch-invariant mode), or the packed row's Segments
        -> (B, T, E)."""
        b, t, _ = x.shape
        q, k, v = self._rotated_qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if self.batch_invariant:
            out = (
                mask.attend(q, k, v, bi.attention)
                if isinstance(mask, Segments)
                else bi.attention(q, k, v, mask)
            )
            heads = out.transpose(1, 2).reshape(b, t, -1)
            out = bi.linear(heads, _weight(self.o_proj), self.o_proj.bias, _packed(self.o_proj))
            return self._adapted(heads, out, OUT)
        if isinstance(mask, Segments):
            out = mask.attend(q, k, v)
        elif t == 1:
            out = decode_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        heads = out.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(heads) if self.fused is None else self._adapted(heads, self.o_proj(heads), OUT)

    def _adapted(self, x: Tensor, out: Tensor, names: tuple[str, ...]) -> Tensor:
        return out if self.low_rank is None else self.low_rank(x, out, names)

    def _rotated_qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, E) -> q (B, H, T, D), k, v (B, Hkv, T, D); q and k rotated by RoPE (and normed
        first, with qk_norm). Out of one matmul (fused or batch-invariant), q and k sit side by side:
        one rotation covers both, element-wise the same values as two, in half the operations."""
        b, t, _ = x.shape
        h, kv, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        qkv = None
        if self.batch_invariant and self.fused is not None:  # one fixed-shape matmul: the engine's
            qkv = bi.linear(x, *self.fused, self.packed)
        elif self.batch_invariant:  # the trainer's, of the same shape
            qkv = bi.linear(x, *_stacked([self.q_proj, self.k_proj, self.v_proj]))
        elif self.fused is not None:
            qkv = packed.linear(x, *self.fused, self.packed)
        if qkv is not None:
            qkv = self._adapted(x, qkv, QKV)
        if qkv is not None and not self.cfg.qk_norm:
            qkv = qkv.view(b, t, -1, d).transpose(1, 2)  # (B, H + 2 Hkv, T, D)
            q, k = apply_rope(qkv[:, : h + kv], cos, sin).split([h, kv], dim=1)
            return q, k, qkv[:, h + kv :]
        if qkv is not None:
            q, k, v = qkv.view(b, t, -1, d).split([h, kv, kv], dim=2)
        else:
            q = self.q_proj(x).view(b, t, -1, d)  # (B, T, H, D)
            k = self.k_proj(x).view(b, t, -1, d)
            v = self.v_proj(x).view(b, t, -1, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        return q, apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def decode_bias(mask: Tensor, cfg: ModelConfig) -> Tensor:
    """mask (B, 1, 1, S) additive -> (Hkv·B, G, S), G = H / Hkv: the layout `decode_attention` adds
    it in, built once per forward rather than once per layer."""
    b, s = mask.shape[0], mask.shape[-1]
    hkv = cfg.num_key_value_heads
    g = cfg.num_attention_heads // hkv
    return mask.view(1, b, 1, s).expand(hkv, b, g, s).reshape(hkv * b, g, s)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """One new token per row: q (B, H, 1, D), k, v (B, Hkv, S, D), bias (Hkv·B, G, S) additive
    (`decode_bias`; G = H / Hkv) -> (B, H, 1, D).

    The same result as `scaled_dot_product_attention`, as two batched matmuls over the Hkv·B key
    heads, each serving its H/Hkv query heads; SDPA's CPU kernel is built for long queries. Both
    caches store keys head-major (k.transpose(0, 1) is (Hkv, B, S, D) with contiguous rows), so
    the big operands are read in place and only the one-token query and output are reshuffled.
    """
    b, h, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv  # query heads per key head, in Hugging Face's order (head i uses key head i // g)
    queries = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)
    keys = k.transpose(0, 1).reshape(hkv * b, s, d).transpose(1, 2)
    values = v.transpose(0, 1).reshape(hkv * b, s, d)
    scores = torch.baddbmm(bias, queries, keys, alpha=d**-0.5)
    out = torch.bmm(scores.softmax(-1), values)  # (Hkv·B, G, D)
    return out.view(hkv, b, h // hkv, d).transpose(0, 1).reshape(b, h, 1, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused: tuple[Tensor, Tensor | None] | None = None  # gate|up weight, bias: fuse_projections
        self.packed: Tensor | None = None  # the fused weight for oneDNN: tandem.model.packed
        self.batch_invariant = False  # set by CausalLM.batch_invariant
        self.low_rank: LowRank | None = None  # as Attention.low_rank

    def forward(self, x: Tensor) -> Tensor:
        hook = self.low_rank
        if self.batch_invariant:
            gate_up = self.fused or _stacked([self.gate_proj, self.up_proj])
            adapters = (
                None if hook is None else (lambda a, o: hook(a, o, GATE_UP), lambda a, o: hook(a, o, DOWN))
            )
            down = (_weight(self.down_proj), self.down_proj.bias)
            return bi.mlp(x, *gate_up, *down, adapters, (self.packed, _packed(self.down_proj)))
        if self.fused is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = packed.linear(x, *self.fused, self.packed)
        if hook is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = hook(x, gate_up, GATE_UP).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return hook(act, self.down_proj(act), DOWN)


class DecoderLayer(nn.Module):
    """Attention, then the feed-forward: the dense `MLP`, or the layer's `SparseMoE` (registered as
    `block_sparse_moe` in Mixtral, as its checkpoints name it; `mlp` reaches either)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg)
        if index in moe_layers(cfg):
            setattr(self, "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp", SparseMoE(cfg, index))
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | Segments,
        layer: int,
        cache: KVCache | BatchCache | None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    @property
    def mlp(self) -> "MLP | SparseMoE":
        return self._modules["mlp" if "mlp" in self._modules else "block_sparse_moe"]  # type: ignore[return-value]


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: tuple[Tensor, Tensor] | None = None  # built on first use, on the model's device
        self._decode_layers = None  # torch.compile'd `_layers` for one-token forwards: compile_decode()
        self._batch_invariant = False
        # While an engine's forward runs rows of several adapters: their table (RowAdapters.use), and
        # the hook that adds each row's adapter of lm_head where they have one (as Attention.low_rank)
        self.row_adapters = None
        self.head_low_rank: LowRank | None = None

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits are bit-identical whatever else is in the batch and whichever
        path computes them (full sequence padded or packed, prefill, chunked prefill, decode on
        either cache): matmuls, the MLP and attention go through `tandem.model.batch_invariant`.
        Off by default (the faster kernels); a decode compiled by `compile_decode` runs eagerly
        while it is on."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)
        for module in self.model.modules():  # every part that declares the flag: attention, MLP, MoE, norms
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = bool(on)

    def compile_decode(self) -> "CausalLM":
        """Run every one-token forward (a decode step) through `torch.compile` from now on.

        Inductor fuses the small element-wise operations around the matmuls into generated C++
        (with a C++ wrapper, so no Python runs between kernels), which is most of a small model's
        decode step on the CPU. The first calls compile (tens of seconds: once static, then again
        with the batch size and cache length dynamic); prefills stay eager. Needs a C++ compiler on
        the CPU. The logits equal the eager ones to float rounding. Returns the model.
        """
        self._decode_layers = torch.compile(self._layers, options={"cpp_wrapper": True})
        return self

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, D). The table is built, or grown, on first need;
        while a CUDA graph records (which allows no host sync) it must already cover `positions`."""
        if not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            needed = int(positions.max()) + 1
            table = self._rope
            if table is None or table[0].device != positions.device or table[0].shape[0] < needed:
                check_positions(self.cfg, needed)
                size = max(self.cfg.max_position_embeddings, needed)  # RoPE itself has no length limit
                self._rope = rope_table(self.cfg, size, positions.device)
        cos, sin = self._rope
        dtype = self.lm_head.weight.dtype
        return cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype)

    @property
    def rope_table(self) -> tuple[Tensor, Tensor] | None:
        """The cos, sin table (positions, D) built so far; a new object whenever it is rebuilt."""
        return self._rope

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        token_mask: Tensor | Segments,
        cache: KVCache | BatchCache | None = None,
        targets: Targets | None = None,
        logits_at: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids, positions, token_mask (B, T) -> logits (B, T, V) in fp32; with `targets`,
        (logp, entropy) (N,) of the target tokens instead (the trainer's forward: the full logits
        never exist, `score_tokens` works in chunks); with `logits_at` (B,), the column of each row
        whose logits are wanted, (B, 1, V) of those alone (an engine's prefill samples from one
        position a row: the rest would be B·T·V floats, 1.2 GB for 64 prompts of 100 tokens with a
        49k vocabulary).

        token_mask marks real tokens (False = padding). With a cache the T tokens are appended after
        the cached ones. A token attends to real keys at or before its own slot, and always to
        itself, so a padding row never has an empty (NaN) softmax. A `BatchCache` (the paged cache)
        gives the mask itself: its rows may hold contexts of any lengths. `Segments` in place of the
        mask: one (1, T) row of sequences packed back to back, each attending only to itself.
        """
        if isinstance(token_mask, Segments):
            return self._run(input_ids, positions, token_mask, None, targets, logits_at)
        if cache is not None and not isinstance(cache, KVCache):
            return self._run(
                input_ids, positions, cache.attention_mask(token_mask), cache, targets, logits_at
            )
        if cache is not None and self.batch_invariant:  # keys at their positions, not left-padded
            cache.append_mask(token_mask)
            view = cache.at_positions(positions, token_mask)
            out = self._run(input_ids, positions, view.attention_mask(token_mask), view, targets, logits_at)
            cache.advance(input_ids.shape[1])
            return out
        if cache is not None:
            cache.append_mask(token_mask)
            key_mask = cache.key_mask[:, : cache.length + input_ids.shape[1]]
        else:
            key_mask = token_mask
        t = input_ids.shape[1]
        out = self._run(input_ids, positions, causal_mask(key_mask, t), cache, targets, logits_at)
        if cache is not None:
            cache.advance(t)
        return out

    def _run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        mask: Tensor | Segments,
        cache: KVCache | BatchCache | None,
        targets: Targets | None = None,
        logits_at: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The layers under a given attention mask (B, 1, T, S) bool (or Segments) -> logits
        (B, T, V) in fp32 ((B, 1, V) at `logits_at`), or (logp, entropy) of `targets`."""
        cos, sin = self.rope(positions)  # outside the compiled part: it reads positions.max()
        if isinstance(mask, Tensor):
            # One additive mask for every layer (SDPA would turn a bool mask into it once per layer),
            # for one token in decode_attention's layout.
            dtype = self.lm_head.weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            if input_ids.shape[1] == 1 and not self.batch_invariant:
                mask = decode_bias(mask, self.cfg)
        if targets is not None:
            hidden = self._backbone(input_ids, cos, sin, mask, cache).flatten(0, 1)[targets.index]  # (N, E)
            weight = _weight(self.lm_head) if self.batch_invariant else self.lm_head.weight
            return score_tokens(
                hidden, weight, targets.tokens, targets.temperature, self.batch_invariant, self._head_delta()
            )
        compiled = self._decode_layers is not None and input_ids.shape[1] == 1 and not self.batch_invariant
        compiled = compiled and self.row_adapters is None  # rows of several adapters: eagerly
        if compiled:
            return self._decode_layers(input_ids, cos, sin, mask, cache)
        return self._layers(input_ids, cos, sin, mask, cache, logits_at)

    def _layers(
        self,
        input_ids: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        cache: KVCache | BatchCache | None,
        logits_at: Tensor | None = None,
    ) -> Tensor:
        hidden = self._backbone(input_ids, cos, sin, mask, cache)
        if logits_at is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            hidden = hidden[rows, logits_at][:, None]  # (B, 1, E)
        head = self.lm_head
        if self.batch_invariant:
            logits = bi.linear(hidden, _weight(head), head.bias, _packed(head))
            delta = self._head_delta()
            logits = logits if delta is None else logits + delta(hidden)
        else:
            logits = head(hidden)  # a LoRA-adapted head adds its own adapter, PEFT's way
        if self.head_low_rank is not None:  # an engine's rows of several adapters
            logits = self.head_low_rank(hidden, logits, HEAD)
        return logits.float()

    def _head_delta(self) -> Callable[[Tensor], Tensor] | None:
        """h (..., E) -> what a LoRA adapter on lm_head (Tinker's train_unembed) adds to the logits
        where they come from the head's weight (scoring, the batch-invariant forward): the adapter's
        own s · B(A(dropout(h))); batch-invariant, `low_rank`'s as an engine adds a row's
        (unmerged form) or nothing (merged: in `_weight`). None without an adapter or with it off."""
        head = self.lm_head
        if not getattr(head, "enabled", False) or (self.batch_invariant and not head.unmerged):
            return None
        a, b, scaling = head.lora_A, head.lora_B, head.scaling
        if self.batch_invariant:
            return lambda h: low_rank(h, a.weight, b.weight, scaling, True)
        return lambda h: b(a(head.dropout(h))) * scaling

    def _backbone(
        self,
        input_ids: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | Segments,
        cache: KVCache | BatchCache | None,
    ) -> Tensor:
        """-> the final norm's output (B, T, E)."""
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, i, cache)
        return self.model.norm(x)


def causal_mask(key_mask: Tensor, t: int) -> Tensor:
    """key_mask (B, S): the slots holding real keys, the new T tokens' last -> (B, 1, T, S) bool: a
    token sees the real keys at or before its own slot, and always itself."""
    s = key_mask.shape[1]
    if t == 1:  # a decode step: every slot is at or before the query's, the last
        mask = key_mask.clone()
        mask[:, -1] = True
        return mask[:, None, None]
    slots = torch.arange(s, device=key_mask.device)
    query_slots = (s - t) + torch.arange(t, device=key_mask.device)
    causal = slots[None, :] <= query_slots[:, None]  # (T, S)
    own = slots[None, :] == query_slots[:, None]
    return ((causal & key_mask[:, None, :]) | own)[:, None]  # (B, 1, T, S)


def meta_model(cfg: ModelConfig) -> CausalLM:
    """A CausalLM of uninitialised meta tensors: its parameters' names and shapes, for what needs no
    values (a checkpoint's expected names, an adapter's shapes) and for `load_model` to fill.
    Initialising a meta tensor runs torch's reference ops, whose first call imports torch._dynamo:
    ~2 s of the start-up of every process that built one (2 cores)."""
    with torch.device("meta"), _no_init():
        return CausalLM(cfg)


@contextmanager
def _no_init() -> Iterator[None]:
    """Within the block, linears and embeddings are built without drawing their initial values (as
    transformers' `no_init_weights` does). Not thread-safe: for one thread building a model."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _stacked(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """The linears' weights (and biases) concatenated row-wise, differentiably: an unfused model's
    batch-invariant forward runs the fused model's matmul, of the same shape."""
    biases = [lin.bias for lin in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    return torch.cat([_weight(lin) for lin in linears]), bias


def _packed(linear: nn.Module) -> Tensor | None:
    """An engine's packed copy of a linear's weight (`tandem.model.packed.PackedLinear`), or None."""
    return getattr(linear, "packed", None)


def _weight(linear: nn.Module) -> Tensor:
    """The weight a linear's forward multiplies by: a LoRA-adapted one's merged with its adapter
    (`tandem.model.lora.LoraLinear.merged_weight`; its base weight in the unmerged form, whose
    adapter the `low_rank` hook adds), for the batch-invariant forward."""
    merged = getattr(linear, "merged_weight", None)
    return linear.weight if merged is None else merged()


def init_weights(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) for matrices and embeddings, ones for norms, zeros for biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
