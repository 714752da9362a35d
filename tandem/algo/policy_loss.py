"""Policy losses: per-token surrogate losses plus per-token diagnostics for the caller to mask-average.

Every loss has one signature so the trainer can call any of them the same way:

    fn(logp, old_logp, advantages, mask (all B, T), *, options) -> (loss (B, T), {name: (B, T)})

Losses and diagnostics are 0 where mask == 0; reduce the loss with `tandem.algo.aggregate`. The
trainer passes the trust region (clip_low, clip_high, clip_c) to every loss, as context that a loss
without one drops; any other option must be one the loss declares. A loss may bring its own
defaults for those algo.* keys (`LossTraits`: gspo's clip range).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.algo.masked import masked_mean
from tandem.registry import OptionRegistry


@dataclass(frozen=True)
class LossTraits:
    # The algo.* defaults the loss brings with it: the config loader applies them where neither the
    # recipe nor an override set the key (docs/config.md, `algo`). The schema's are ppo_clip's.
    defaults: Mapping[str, float] = field(default_factory=dict)


PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: OptionRegistry[PolicyLossFn] = OptionRegistry(
    "policy loss", context=["clip_low", "clip_high", "clip_c"], traits=LossTraits
)


# GSPO's own clip range (the paper's): a geometric mean of token ratios stays far closer to 1 than one
# token's ratio, so ppo_clip's 0.2 / 0.28 would clip nothing.
GSPO_CLIP_LOW, GSPO_CLIP_HIGH = 3e-4, 4e-4
_LOG_CLAMP = 20.0  # one far-off logprob must not overflow exp() and turn the batch to inf/nan


def _check_clip(clip_low: float, clip_high: float, clip_c: float | None) -> None:
    if not 0 <= clip_low < 1:
        raise ValueError(
            f"clip_low must be in [0, 1) so the lower ratio bound stays positive, got {clip_low}"
        )
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"clip_c (dual-clip bound) must be > 1 or None, got {clip_c}")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """logp, old_logp, advantages, mask (B, T) -> loss (B, T), diagnostics {name: (B, T)}.

    ratio = exp(logp - old_logp)
    loss  = max(-A·ratio, -A·clip(ratio, 1 - clip_low, 1 + clip_high))   (clip_high > clip_low: DAPO)
    dual clip (clip_c > 1): for A < 0, loss = min(loss, -A·clip_c)
    Diagnostics: "pg_clipfrac" 1 where the clipped branch was taken, "pg_clipfrac_lower" 1 where
    the dual-clip bound was, "ppo_kl" = old_logp - logp.
    """
    _check_clip(clip_low, clip_high, clip_c)
    # Clamped as verl does; where the clamp acts the token gets no gradient (clamp's derivative is 0).
    ratio = torch.exp((logp - old_logp).clamp(-_LOG_CLAMP, _LOG_CLAMP))
    return _clipped_surrogate(ratio, logp, old_logp, advantages, mask, clip_low, clip_high, clip_c)


def _clipped_surrogate(
    ratio: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The (dual-)clipped surrogate of a (B, T) ratio, and the diagnostics every clipped loss reports."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    took_dual = torch.zeros_like(took_clip)
    if clip_c is not None:
        bound = -advantages * clip_c
        took_dual = (advantages < 0) & (loss > bound)
        loss = torch.where(took_dual, bound, loss)
    keep = mask.bool()
    metrics = {
        "pg_clipfrac": took_clip.to(loss.dtype),
        "pg_clipfrac_lower": took_dual.to(loss.dtype),
        "ppo_kl": old_logp - logp,
    }
    metrics = {name: torch.where(keep, value, 0.0) for name, value in metrics.items()}
    return torch.where(keep, loss, 0.0), metrics


@POLICY_LOSSES.register("gspo", defaults={"clip_low": GSPO_CLIP_LOW, "clip_high": GSPO_CLIP_HIGH})
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = GSPO_CLIP_LOW,
    clip_high: float = GSPO_CLIP_HIGH,
    clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """logp, old_logp, advantages, mask (B, T) -> loss (B, T), diagnostics {name: (B, T)}.

    GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in the paper's token-level
    stop-gradient form (GSPO-token):
    s_i     = exp(mean_t (logp - old_logp))                over sequence i's masked tokens
    s_{i,t} = sg[s_i] · exp(logp_t - sg[logp_t])           value s_i; gradient s_i · ∇logp_t
    loss    = max(-A·s_{i,t}, -A·clip(s_{i,t}, 1 - clip_low, 1 + clip_high)), dual clip as ppo_clip
    Every token of a sequence shares one ratio, so the clip keeps or drops whole sequences. A
    geometric mean of per-token ratios stays far closer to 1 than a token ratio, so GSPO clips far
    tighter: the paper uses clip_low = 3e-4, clip_high = 4e-4 (the defaults here, and algo.clip_low /
    algo.clip_high's with policy_loss=gspo) and averages per sequence (seq-mean-token-mean).
    log s_i is clamped to ±20 as ppo_clip's token log-ratio is, and like that clamp it stops the
    gradient: a sequence the clamp acted on contributes its clamped value and no gradient.
    Diagnostics as ppo_clip; "ppo_kl" stays per token.
    """
    _check_clip(clip_low, clip_high, clip_c)
    keep = mask.bool()
    raw = masked_mean(logp - old_logp, keep, dim=-1).detach()  # (B,)
    seq_log_ratio = raw.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    unclamped = (raw == seq_log_ratio)[:, None]  # (B, 1)
    # where() before exp(): garbage logprobs in the padding never reach the value or the gradient.
    token_part = torch.where(keep & unclamped, logp - logp.detach(), 0.0)  # 0 in value, ∇logp in gradient
    ratio = torch.exp(seq_log_ratio[:, None] + token_part)
    return _clipped_surrogate(ratio, logp, old_logp, advantages, mask, clip_low, clip_high, clip_c)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """logp, old_logp, advantages, mask (B, T) -> loss (B, T), diagnostics {name: (B, T)}.

    CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, and the
    gradient flows through the log-probability only:
    r    = exp(logp - old_logp)
    w    = sg[clip(r, 1 - clip_low, 1 + clip_high)]
    loss = -w · A · logp                                   gradient -w · A · ∇logp
    Unlike ppo_clip, a token whose ratio leaves the range keeps its gradient (at the clipped
    weight) instead of losing it, so rare tokens that matter are not dropped from the update.
    Diagnostics: "pg_clipfrac" 1 where the weight was clipped (either side), "pg_clipfrac_lower" 1
    where it was clipped from below, "ppo_kl" = old_logp - logp.
    """
    _check_clip(clip_low, clip_high, None)
    keep = mask.bool()
    ratio = torch.exp((logp - old_logp).detach().clamp(-_LOG_CLAMP, _LOG_CLAMP))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -weight * advantages * torch.where(keep, logp, 0.0)
    metrics = {
        "pg_clipfrac": (weight != ratio).to(loss.dtype),
        "pg_clipfrac_lower": (ratio < 1 - clip_low).to(loss.dtype),
        "ppo_kl": old_logp - logp,
    }
    metrics = {name: torch.where(keep, value, 0.0) for name, value in metrics.items()}
    return torch.where(keep, loss, 0.0), metrics
