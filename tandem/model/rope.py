"""Rotary position embedding: inverse frequencies, plain or scaled for long context, and their tables.

A scaling type only changes the inverse frequencies (and, for yarn, a factor on cos and sin); the
rotation itself is the same. Each type computes what transformers' `modeling_rope_utils` computes,
in the same float32 order, so logits match Hugging Face's at any position.
"""

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from tandem.errors import TandemError


class RopeShape(Protocol):
    """What RoPE reads of a model's config (`tandem.model.config.ModelConfig` has these fields)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


# (cfg, device) -> inverse frequencies (D/2,), factor on cos and sin.
InvFreq = Callable[[RopeShape, torch.device], tuple[Tensor, float]]
ROPE_TYPES: dict[str, InvFreq] = {}
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {}
REFUSED: dict[str, str] = {}
# Rope types whose frequencies are the plain ones up to max_position_embeddings and depend on the
# forward's longest position past it: the decoder refuses positions past it (`check_positions`).
WITHIN_CONTEXT_ONLY = {"dynamic"}


def register(name: str, *required: str) -> Callable[[InvFreq], InvFreq]:
    """Add a scaling type whose parameters must include `required`."""

    def add(fn: InvFreq) -> InvFreq:
        ROPE_TYPES[name] = fn
        REQUIRED_KEYS[name] = required
        return fn

    return add


def check_scaling(params: dict[str, Any], source: str) -> None:
    """TandemError naming the rope type (or the missing key) unless `inv_freq` can compute `params`."""
    rope_type = params["rope_type"]
    if rope_type in REFUSED:
        raise TandemError(f"{source}: rope_type {rope_type!r} is not supported: {REFUSED[rope_type]}.")
    if rope_type not in ROPE_TYPES:
        raise TandemError(
            f"{source}: rope_type {rope_type!r} is not supported. Valid rope types: {', '.join(ROPE_TYPES)}."
        )
    missing = [k for k in REQUIRED_KEYS[rope_type] if params.get(k) is None]
    if missing:
        raise TandemError(f"{source}: rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters.")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise TandemError(
            f"{source}: partial_rotary_factor={partial} is not supported; tandem rotates the whole head."
        )


def _exponents(head_dim: int, device: torch.device) -> Tensor:
    """(D/2,) 2i/D."""
    return torch.arange(0, head_dim, 2, device=device).float() / head_dim


@register("default")
def _default(cfg: RopeShape, device: torch.device) -> tuple[Tensor, float]:
    """inv_freq_i = theta^(-2i/D)."""
    return 1.0 / (cfg.rope_theta ** _exponents(cfg.head_dim, device)), 1.0


@register("linear", "factor")
def _linear(cfg: RopeShape, device: torch.device) -> tuple[Tensor, float]:
    """Position interpolation: every frequency divided by `factor` (positions p -> p / factor)."""
    inv_freq, _ = _default(cfg, device)
    return inv_freq / cfg.rope_scaling["factor"], 1.0


@register("llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
def _llama3(cfg: RopeShape, device: torch.device) -> tuple[Tensor, float]:
    """Llama 3.1: with L = original length, wavelengths over L / low_freq_factor are divided by
    `factor`, those under L / high_freq_factor kept, and those between blended linearly in L / wavelength.
    """
    p = cfg.rope_scaling
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    context = p["original_max_position_embeddings"]
    inv_freq, _ = _default(cfg, device)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)  # 0 at the long end, 1 at the short end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(between, blended, scaled), 1.0


@register("yarn", "original_max_position_embeddings")
def _yarn(cfg: RopeShape, device: torch.device) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn more than beta_fast times over the original
    length keep their frequency, those turning under beta_slow times are interpolated by `factor`,
    a linear ramp between. cos and sin are scaled by the attention factor, 0.1·ln(factor) + 1 unless given.
    """
    p = cfg.rope_scaling
    context = p["original_max_position_embeddings"]
    # DeepSeek-style configs leave factor out: the ratio of the new length to the original.
    factor = p.get("factor") or cfg.max_position_embeddings / context
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    dim, theta = cfg.head_dim, cfg.rope_theta

    def dim_turning(turns: float) -> float:
        """The (fractional) dimension index whose wavelength fits `turns` times in the original length."""
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_turning(p.get("beta_fast") or 32), dim_turning(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1).to(device)  # (D/2,)
    wavelength = theta ** _exponents(dim, device)
    keep = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1.0 / (factor * wavelength)) * (1 - keep) + (1.0 / wavelength) * keep
    return inv_freq, attention


@register("dynamic", "factor")
def _dynamic(cfg: RopeShape, device: torch.device) -> tuple[Tensor, float]:
    """Dynamic NTK: base' = base · (factor · L / C − (factor − 1))^(D / (D − 2)) with L the longest
    position of the forward and C = max_position_embeddings, L taken as C when shorter. Up to C the
    base is unchanged, so these are the plain frequencies; past C they would change with the
    longest sequence of each forward (in transformers, of any earlier one too) and a token's
    logprob would depend on its batch, so the decoder refuses positions past C for this type.
    """
    return _default(cfg, device)


def check_positions(cfg: RopeShape, needed: int) -> None:
    """ValueError when a forward needs positions the rope type computes only within the context."""
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
    if rope_type in WITHIN_CONTEXT_ONLY and needed > cfg.max_position_embeddings:
        raise ValueError(
            f"rope_type {rope_type!r} is computed exactly only within max_position_embeddings="
            f"{cfg.max_position_embeddings}; this forward reaches position {needed - 1}. Past it the "
            "frequencies would depend on the batch's longest sequence."
        )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(cfg: RopeShape, device: torch.device) -> tuple[Tensor, float]:
    """-> inverse frequencies (D/2,) of cfg's rope type, and the factor that scales cos and sin."""
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
    return ROPE_TYPES[rope_type](cfg, device)


def rope_table(cfg: RopeShape, max_positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, signed sin (max_positions, D) for rotate-half RoPE: angle(p, i) = p · inv_freq_i, both
    times the rope type's attention factor (1 but for yarn).

    The sin table's first half is negated, so `apply_rope` rotates with one `roll` (no negation).
    """
    freq, scale = inv_freq(cfg, device)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * freq  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = cfg.head_dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., D); x·cos + rotate_half(x)·sin with rotate_half(a, b) = (-b, a).

    `sin` is rope_table's signed table, so rotate_half(x)·sin = roll(x, D/2)·signed_sin exactly.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
