"""Advantage estimators: sequence rewards -> per-token advantages.

Every estimator has one signature so the trainer can call any of them the same way:

    fn(rewards (B,), group_ids (B,) long, mask (B, T), *, options) -> (B, T)

The result is 0 where mask == 0. `gae`, PPO's estimator with a critic, also takes the critic's
`values` (B, T) and gives each token its own advantage. Samples of one prompt share a group id;
ids need not be contiguous or sorted. The trainer passes `norm_by_std` (algo.norm_by_std) to
every estimator, as context that one without a use for it drops; any other option (`eps`) must be
one the estimator declares. Each estimator declares its traits (`EstimatorTraits`), which the config
checks, placement and the simulator read: `ADV_ESTIMATORS.traits(name).needs_critic`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.algo.masked import masked_whiten
from tandem.registry import OptionRegistry


@dataclass(frozen=True)
class EstimatorTraits:
    # It takes a critic's `values`: the run adds PPO's value model (placement task `critic`), which
    # computes the advantages where the values live.
    needs_critic: bool = False


AdvantageFn = Callable[..., Tensor]
ADV_ESTIMATORS: OptionRegistry[AdvantageFn] = OptionRegistry(
    "advantage estimator", context=["norm_by_std"], traits=EstimatorTraits
)


def _float_rewards(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """Checks the shapes agree (a mismatch here would silently misalign samples) and returns float rewards."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape or mask.dim() != 2 or len(mask) != len(rewards):
        raise ValueError(
            "expected rewards (B,), group_ids (B,), mask (B, T); got "
            f"{tuple(rewards.shape)}, {tuple(group_ids.shape)}, {tuple(mask.shape)}"
        )
    return rewards if rewards.is_floating_point() else rewards.float()


def group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """rewards (B,) float, group_ids (B,) -> (mean_g, std_g, n_g), each (B,): stats of each sample's group.

    std_g is unbiased (divides by n_g - 1, as torch.std and verl); a group of one has std 0.
    """
    groups, dense = torch.unique(group_ids, return_inverse=True)  # dense: (B,) group index in 0..G-1
    zeros = rewards.new_zeros(len(groups))
    n = zeros.index_add(0, dense, torch.ones_like(rewards))
    mean = (zeros.index_add(0, dense, rewards) / n)[dense]
    # Two passes (mean, then squared deviations) rather than E[r^2] - E[r]^2, which cancels badly.
    sq_dev = zeros.index_add(0, dense, (rewards - mean) ** 2)
    std = (sq_dev / (n - 1).clamp(min=1)).sqrt()
    return mean, std[dense], n[dense]


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with 0 where den == 0: with eps=0 a constant group is 0 / 0, and its advantage is 0."""
    return torch.where(den != 0, num / den, 0.0)


def _to_tokens(per_seq: Tensor, mask: Tensor) -> Tensor:
    """per_seq (B,), mask (B, T) -> (B, T): each response token gets its sequence's value, 0 off-mask."""
    return torch.where(mask.bool(), per_seq[:, None], 0.0)


@ADV_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, mask: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """rewards (B,), group_ids (B,), mask (B, T) -> (B, T).

    A_i = (r_i - mean_g) / (std_g + eps), std unbiased; with norm_by_std=False, A_i = r_i - mean_g
    (Dr. GRPO). A group of one has no baseline and gets 0.
    """
    r = _float_rewards(rewards, group_ids, mask)
    mean, std, _n = group_stats(r, group_ids)
    adv = r - mean
    if norm_by_std:
        adv = _safe_div(adv, std + eps)
    return _to_tokens(adv, mask)


@ADV_ESTIMATORS.register("drgrpo")
def drgrpo_advantages(rewards: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-6) -> Tensor:
    """rewards (B,), group_ids (B,), mask (B, T) -> (B, T). A_i = r_i - mean_g (Dr. GRPO).

    Ignores norm_by_std: dividing by std is exactly the bias Dr. GRPO removes.
    """
    return grpo_advantages(rewards, group_ids, mask, norm_by_std=False, eps=eps)


@ADV_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """rewards (B,), group_ids (B,), mask (B, T) -> (B, T).

    A_i = r_i - mean_{j != i in g} r_j = n_g / (n_g - 1) · (r_i - mean_g); a group of one gets 0.
    """
    r = _float_rewards(rewards, group_ids, mask)
    mean, _std, n = group_stats(r, group_ids)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), 0.0)
    return _to_tokens(scale * (r - mean), mask)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-6
) -> Tensor:
    """rewards (B,), group_ids (B,), mask (B, T) -> (B, T).

    G_{i,t} = r_i (gamma = 1, reward on the last token, so every return-to-go is r_i), then
    A = (G - mean) / (std + eps) over all masked tokens of the batch. group_ids and norm_by_std
    are unused: REINFORCE++ whitens over the batch, never per group.
    """
    r = _float_rewards(rewards, group_ids, mask)
    return masked_whiten(_to_tokens(r, mask), mask, eps)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-6
) -> Tensor:
    """rewards (B,), group_ids (B,), mask (B, T) -> (B, T).

    G_{i,t} = r_i - mean_g, then A = (G - mean) / (std + eps) over all masked tokens of the batch.
    A group of one subtracts its own reward, so its tokens enter the whitening as 0.
    """
    r = _float_rewards(rewards, group_ids, mask)
    mean, _std, _n = group_stats(r, group_ids)
    return masked_whiten(_to_tokens(r - mean, mask), mask, eps)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """rewards (B,), values (B, T), mask (B, T) over each response's tokens -> advantages, returns (B, T).

    The steps of the episode are the tokens where mask == 1; the masked ones inside a response (a
    tool's output, a user turn) are not the policy's actions, so GAE runs over the masked-in tokens
    as one sequence and carries its value and advantage across the masked ones (as verl's
    multi-turn GAE does). The sequence reward is the last masked-in token's reward (r_t = 0 before
    it), and the value past it is 0:

        δ_t = r_t + γ V_next(t) - V_t,    A_t = δ_t + γ λ A_next(t),    G_t = A_t + V_t

    with next(t) the next masked-in token (Schulman et al. 2016). γ = λ = 1 gives A_t = r - V_t,
    the reward to go against the critic's baseline. Both results are 0 where mask == 0.
    """
    r = rewards.float()
    m = mask.float()
    last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & (m > 0)  # (B, T) the final token
    token_rewards = torch.where(last, r[:, None], 0.0)
    v = values.float() * m
    adv = torch.zeros_like(v)
    next_adv = next_value = torch.zeros_like(r)
    for t in reversed(range(v.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        keep = m[:, t] > 0  # a masked token passes the next step's value and advantage on
        next_adv = torch.where(keep, a, next_adv)
        next_value = torch.where(keep, v[:, t], next_value)
    return adv, (adv + v) * m


@ADV_ESTIMATORS.register("gae", needs_critic=True)
def gae_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """rewards (B,), group_ids (B,), mask (B, T), values (B, T) from a critic -> (B, T).

    PPO's advantage: A = whiten(GAE(γ, λ)) over the masked tokens of the batch (see `gae`).
    group_ids and norm_by_std are unused. The critic (`tandem.train.critic`) computes the same
    from the one `gae` pass that also gives its returns, where the values live, and hands it to the
    policy's trainers in `Sample.token_advantages`.
    """
    r = _float_rewards(rewards, group_ids, mask)
    return masked_whiten(gae(r, values, mask, gamma, lam)[0], mask, eps)
