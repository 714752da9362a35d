"""Off-policy and train/inference-mismatch corrections: per-token weights and masks for the pg loss.

Three logprobs of each sampled response token meet here: μ (`behaviour_logp`, from the rollout
engine), π_old (`old_logp`, the denominator of the PPO ratio: the trainer's recompute at step
start, μ under `bypass`, π_prox under `decoupled`) and π_θ (`logp`, the policy being trained,
detached). In async RL μ differs from π_old (stale weights, engine numerics); these entries
correct for that. Every entry has one signature, so the trainer can chain any of them:

    fn(logp, old_logp, behaviour_logp, advantages, mask (all B, T), **options)
        -> (weight (B, T), mask (B, T), metrics {name: float})

`weight` is a detached multiplier on the per-token policy-gradient loss, 0 where the returned
mask is 0. The returned mask is the input mask less the tokens the entry rejects; the trainer
aggregates the pg loss over it, so rejected tokens leave the loss's denominator too. Metrics are
shares of the input mask's tokens (for a sequence-level entry: of the tokens in the sequences it
hit), so they add up across micro-batches as token-weighted means. The trainer passes every entry
the same context: cap (algo.correction_cap), low and high (algo.mis_low, algo.mis_high), delta
(algo.opsm_delta); an entry drops the ones it has no use for, and any other keyword is an error.
Rows are whole sequences, so sequence-level entries give the same result on any split of a batch
into rows.

Each entry declares what the config checks, the trainer and the simulator ask of it
(`CorrectionTraits`: whether it weights, masks, reads π_θ, or changes what π_old is), so none of
them compares correction names.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from tandem.algo.kl import kl_k3
from tandem.algo.masked import masked_mean
from tandem.registry import OptionRegistry


@dataclass(frozen=True)
class CorrectionTraits:
    """What the config checks, the trainer and the simulator ask of an entry."""

    weights: bool = False  # it weights by π_old/μ (or π_prox/μ): two such would apply the ratio twice
    masks: bool = False  # it can drop tokens from the loss mask (the others only weight)
    old_is_behaviour: bool = False  # bypass: π_old is μ, so there is no π_old/μ left to weight by
    old_is_prox: bool = False  # decoupled: π_old is π_prox, which algo.prox_logprob chooses
    reads_theta: bool = False  # its mask reads π_θ (logp), which costs a forward when it is not π_old


CorrectionFn = Callable[..., tuple[Tensor, Tensor, dict[str, float]]]
CORRECTIONS: OptionRegistry[CorrectionFn] = OptionRegistry(
    "correction", context=["cap", "low", "high", "delta"], traits=CorrectionTraits
)
_LOG_CLAMP = 20.0  # as the policy losses: one far-off logprob must not overflow exp()


def _log_ratio(num: Tensor, den: Tensor, keep: Tensor) -> Tensor:
    """log(num/den) (B, T), detached, clamped to ±20; 0 off the mask, where padding may hold garbage."""
    return torch.where(keep, (num - den).detach().clamp(-_LOG_CLAMP, _LOG_CLAMP), 0.0)


def _truncate(log_w: Tensor, cap: float | None) -> tuple[Tensor, Tensor]:
    """log_w -> (min(exp(log_w), cap), where the cap acted). Taken in log space: exp never overflows."""
    if cap is None:
        return log_w.exp(), torch.zeros_like(log_w, dtype=torch.bool)
    log_cap = math.log(cap)
    return torch.exp(log_w.clamp(max=log_cap)), log_w > log_cap


def _share(flags: Tensor, keep: Tensor) -> float:
    """Share of the masked tokens where flags is true; 0 for an empty mask."""
    return float((flags & keep).sum()) / max(int(keep.sum()), 1)


def _token_is(
    name: str, old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float | None
) -> tuple[Tensor, Tensor, dict[str, float]]:
    keep = mask.bool()
    w, clipped = _truncate(_log_ratio(old_logp, behaviour_logp, keep), cap)
    return torch.where(keep, w, 0.0), mask, {f"correction/{name}_clipfrac": _share(clipped, keep)}


@CORRECTIONS.register("tis", weights=True)
def tis_correction(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Token TIS (truncated importance sampling), all (B, T). w_t = min(π_old/μ, C); mask unchanged.

    Corrects the pg gradient for tokens sampled from μ rather than π_old, with the variance bounded
    by C (cap=None: plain, untruncated IS). Biased only where the cap acts. Metric
    `correction/tis_clipfrac`: share of tokens with π_old/μ > C.
    """
    return _token_is("tis", old_logp, behaviour_logp, mask, cap)


@CORRECTIONS.register("seq_tis", weights=True)
def seq_tis_correction(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Sequence TIS, all (B, T). w_i = min(prod_t π_old/μ, C) on every token of sequence i.

    The product is exp(sum_t log(π_old/μ)) over the masked tokens, clamped to e^±20. Unbiased for
    the sequence likelihood ratio below C, but its variance grows with the length. Metric
    `correction/seq_tis_clipfrac`: share of tokens in sequences whose product exceeded C.
    """
    keep = mask.bool()
    log_w = _log_ratio(old_logp, behaviour_logp, keep).sum(-1, keepdim=True)  # (B, 1)
    w, clipped = _truncate(log_w.clamp(-_LOG_CLAMP, _LOG_CLAMP), cap)
    metrics = {"correction/seq_tis_clipfrac": _share(clipped.expand_as(keep), keep)}
    return torch.where(keep, w, 0.0), mask, metrics


@CORRECTIONS.register("icepop", weights=True, masks=True)
@CORRECTIONS.register("mis", weights=True, masks=True)
def mis_correction(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Token MIS (masked importance sampling; IcePop), all (B, T). w_t = r_t · 1[low <= r_t <= high].

    r_t = π_old/μ. Tokens outside [low, high] leave the mask: a token the engine and the trainer
    disagree on that much is noise, not signal, so it is dropped rather than down-weighted. Metric
    `correction/mis_maskfrac`: share of tokens dropped.
    """
    keep = mask.bool()
    w = _log_ratio(old_logp, behaviour_logp, keep).exp()
    inside = (w >= low) & (w <= high)
    kept = keep & inside
    return torch.where(kept, w, 0.0), kept.to(mask.dtype), {"correction/mis_maskfrac": _share(~inside, keep)}


@CORRECTIONS.register("seq_mask_tis", weights=True, masks=True)
def seq_mask_tis_correction(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Geometric-mean sequence mask + token TIS, all (B, T). Follows verl's "geo RS + token TIS".

    g_i = exp(mean_t log(π_old/μ)) over sequence i's masked tokens (length-normalised, so long
    responses are not rejected for their length alone). Sequences with g_i outside [low, high]
    leave the mask; the rest get token TIS, w_t = min(π_old/μ, C). verl's preset
    (`decoupled_geo_rs_token_tis`: rollout_rs=seq_mean_k1, rollout_is=token) bounds g to
    [0.999, 1.001] and caps at 2. Metrics: `correction/seq_mask_tis_maskfrac` (share of tokens in
    dropped sequences), `correction/seq_mask_tis_clipfrac` (share of tokens kept and capped).
    """
    keep = mask.bool()
    log_r = _log_ratio(old_logp, behaviour_logp, keep)
    g = masked_mean(log_r, keep, dim=-1).exp()[:, None]  # (B, 1)
    inside = ((g >= low) & (g <= high)).expand_as(keep)
    kept = keep & inside
    w, clipped = _truncate(log_r, cap)
    metrics = {
        "correction/seq_mask_tis_maskfrac": _share(~inside, keep),
        "correction/seq_mask_tis_clipfrac": _share(clipped & inside, keep),
    }
    return torch.where(kept, w, 0.0), kept.to(mask.dtype), metrics


@CORRECTIONS.register("opsm", masks=True, reads_theta=True)
def opsm_correction(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    delta: float = 1e-4,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Off-Policy Sequence Masking (DeepSeek-V3.2), all (B, T). Weight 1 on the tokens kept.

    Sequence i leaves the mask when A_i < 0 and mean_t (log π_old − log π_θ) > delta over its
    masked tokens: a negative sample the policy has drifted far from teaches little and
    destabilises. As slime (`compute_opsm_mask`, default delta 1e-4), π_old is the ratio's
    denominator: the recompute by default, μ under `bypass`, which is the paper's setting (its
    π_old is the sampling policy). Metric `correction/opsm_maskfrac`: share of tokens in dropped
    sequences.
    """
    keep = mask.bool()
    negative = masked_mean(advantages, keep, dim=-1) < 0  # (B,): A is one value per sequence
    drift = masked_mean(old_logp - logp.detach(), keep, dim=-1)  # (B,)
    drop = (negative & (drift > delta))[:, None].expand_as(keep)
    kept = keep & ~drop
    return kept.to(old_logp.dtype), kept.to(mask.dtype), {"correction/opsm_maskfrac": _share(drop, keep)}


@CORRECTIONS.register("decoupled", weights=True, old_is_prox=True)
def decoupled_correction(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """AReaL's decoupled PPO behaviour weight, all (B, T). w_t = min(π_prox/μ, C); mask unchanged.

    Here old_logp is π_prox, the proximal policy the PPO ratio is clipped against; the trainer
    takes it from the recompute at step start (then this equals `tis`) or, with
    algo.prox_logprob=interpolate, from `interpolate_prox_logp` (no recompute pass). cap=None
    leaves the weight untruncated, as AReaL without a cap. Metric `correction/decoupled_clipfrac`:
    share of tokens with π_prox/μ > C.
    """
    return _token_is("decoupled", old_logp, behaviour_logp, mask, cap)


@CORRECTIONS.register("bypass", old_is_behaviour=True)
def bypass_correction(
    logp: Tensor, old_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Bypass, all (B, T): the trainer uses μ as π_old and skips its recompute forward pass.

    The entry itself is the identity (weight 1 on the mask, no metrics): with π_old = μ the PPO
    ratio π_θ/μ already is the importance ratio to the behaviour policy, and there is no π_old/μ
    left to correct. Cheapest; trusts the engine's logprobs as the trust-region anchor.
    """
    return mask.bool().to(old_logp.dtype), mask, {}


def apply_corrections(
    names: Sequence[str],
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **options,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Chain the named entries, all (B, T) -> (weight, mask, metrics). weight = prod of theirs, 0
    off the returned mask; mask = AND of theirs; metrics merged.

    Every entry sees the input mask, so each reports shares of the same tokens. With no names:
    weight 1 on the mask, mask unchanged, no metrics. TandemError for an unknown name.
    """
    keep = mask.bool()
    weight = keep.to(old_logp.dtype)
    metrics: dict[str, float] = {}
    for name in names:
        w, m, stats = CORRECTIONS.get(name)(
            logp.detach(), old_logp, behaviour_logp, advantages, mask, **options
        )
        weight = weight * w
        keep = keep & m.bool()
        metrics.update(stats)
    return torch.where(keep, weight, 0.0).detach(), keep.to(mask.dtype), metrics


class OldSource(str, Enum):
    """Where a step's π_old comes from; the trainer logs actor/old_logprob_source/<value> = 1."""

    RECOMPUTE = "recompute"  # the trainer's forward pass at step start
    POLICY = "policy"  # π_θ detached, from the update's own forward (an exactly on-policy step)
    BEHAVIOUR = "behaviour"  # μ: bypass, or the engine's logprobs when they are exact
    INTERPOLATE = "interpolate"  # decoupled's π_prox, between μ and π_θ


def old_logprob_source(names: Sequence[str], prox_logprob: str = "recompute") -> OldSource:
    """Where the corrections `names` take the PPO ratio's π_old from: BEHAVIOUR (bypass: μ),
    INTERPOLATE (decoupled with prox_logprob=interpolate) or RECOMPUTE (the trainer's forward pass
    at step start). Only RECOMPUTE costs a forward pass."""
    if any(CORRECTIONS.traits(n).old_is_behaviour for n in names):
        return OldSource.BEHAVIOUR
    if any(CORRECTIONS.traits(n).old_is_prox for n in names) and prox_logprob == "interpolate":
        return OldSource.INTERPOLATE
    return OldSource.RECOMPUTE


def interpolate_prox_logp(
    behaviour_logp: Tensor, logp: Tensor, versions: Tensor, prox_version: int, theta_version: int
) -> Tensor:
    """behaviour_logp, logp, versions (B, T) -> log π_prox (B, T), detached, by AReaL's log-linear
    proximal-logprob approximation (`compute_prox_logp_approximations`, method "loglinear").

    log π_prox ≈ log μ + α·(log π_θ − log μ),  α = clamp((v_prox − v_μ) / (v_θ − v_μ), 0, 1)

    per token, with v_μ the version that sampled it: the log-probability is taken to move linearly
    with the version from μ to π_θ. α = 0 (π_prox = μ) where v_μ < 0 (unknown) or v_θ <= v_μ.
    The trainer passes its step-start version as v_prox (the weights a recompute would use) and
    the next one as v_θ (what the weights being trained become); AReaL passes its engine version
    and the one before, one lower on both.
    """
    v = versions.to(logp.dtype)
    span = theta_version - v
    alpha = torch.where((span > 0) & (versions >= 0), (prox_version - v) / span.clamp(min=1), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    return (behaviour_logp + alpha * (logp.detach() - behaviour_logp)).detach()


def mismatch_metrics(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """old_logp (π_old), behaviour_logp (μ), mask (B, T) -> how far the engine's logprobs are from
    the trainer's, over the masked tokens (all 0 for an empty mask).

    mismatch/logprob_abs_diff_{max,mean}: |log π_old − log μ|. mismatch/ratio_mean: mean π_old/μ.
    mismatch/kl: KL(μ ‖ π_old) by the k3 estimator on the sampled tokens, E_μ[r − 1 − log r] with
    r = π_old/μ: unbiased (E_μ[r] = 1), never negative, and exactly 0 when μ == π_old; k1,
    mean(log μ − log π_old), is noisier and goes negative.
    """
    keep = mask.bool()
    old, mu = old_logp[keep], behaviour_logp[keep]
    if not old.numel():
        names = ("logprob_abs_diff_max", "logprob_abs_diff_mean", "kl", "ratio_mean")
        return {f"mismatch/{n}": 0.0 for n in names}
    diff = (old - mu).abs()
    return {
        "mismatch/logprob_abs_diff_max": float(diff.max()),
        "mismatch/logprob_abs_diff_mean": float(diff.mean()),
        "mismatch/kl": float(kl_k3(mu, old).mean()),
        "mismatch/ratio_mean": float((old - mu).clamp(-_LOG_CLAMP, _LOG_CLAMP).exp().mean()),
    }
