"""A step's advantages, from its samples: the configured estimator over the rewards of each group
(`tandem.algo.advantages`, per tensor), the critic's per token (gae), a distillation teacher's per-token
reverse KL, and an agent episode's extra samples given their episode's advantage.
"""

import torch
from torch import Tensor

from tandem.algo import ADV_ESTIMATORS
from tandem.config import AlgoConfig
from tandem.errors import TandemError
from tandem.sample import Sample
from tandem.train.batch import pad_rows


def advantages(samples: list[Sample], mask: Tensor, algo: AlgoConfig) -> Tensor:
    """(B, R) advantages from the samples' rewards and groups, or (gae) the critic's per token;
    with a distillation teacher, its per-token reverse KL (alone, or added to those); each
    sample's mean is stored on it."""
    adv = task_advantages(samples, mask, algo)
    distill = algo.distill
    if distill.teacher:
        adv = distill_advantages(samples, mask, algo) + (adv if distill.task_reward else 0.0)
    for s, row, m in zip(samples, adv, mask, strict=True):
        s.advantage = float((row * m).sum() / m.sum().clamp(min=1))
    return adv


def distill_advantages(samples: list[Sample], mask: Tensor, algo: AlgoConfig) -> Tensor:
    """coef x (log π_teacher - log μ) per sampled token: the negative of the per-token reverse
    KL(student ‖ teacher) estimate, μ the student's own sampling logprobs. Where the teacher
    finds a token likelier than the student did, the step raises it."""
    missing = [s for s in samples if len(s.teacher_logprobs) != len(s.response_ids)]
    if missing:
        raise TandemError(
            f"algo.distill.teacher is set but sample {missing[0].group_id}/{missing[0].index} has no "
            "teacher_logprobs (the teacher worker scores every sample before it is trained on)."
        )
    width = mask.shape[1]
    teacher = pad_rows([s.teacher_logprobs for s in samples], width)
    student = pad_rows([s.logprobs for s in samples], width)
    return algo.distill.coef * (teacher - student) * mask


def task_advantages(samples: list[Sample], mask: Tensor, algo: AlgoConfig) -> Tensor:
    """(B, R) advantages from the samples' rewards and groups, or (gae) the critic's per token."""
    if ADV_ESTIMATORS.traits(algo.adv_estimator).needs_critic:  # the critic computed them
        missing = [s for s in samples if len(s.token_advantages) != len(s.response_ids)]
        if missing:
            raise TandemError(
                f"algo.adv_estimator=gae but sample {missing[0].group_id}/{missing[0].index} has no "
                "advantages from the critic (CriticWorker.estimate runs before the policy's step)."
            )
        adv = pad_rows([s.token_advantages for s in samples], mask.shape[1]) * mask
    else:  # over episodes: an episode's extra samples take its advantage, not a group place
        own = [i for i, s in enumerate(samples) if s.episode_of is None]
        rewards = torch.tensor([samples[i].reward for i in own], dtype=torch.float)
        groups = torch.tensor([samples[i].group_id for i in own])
        estimator = ADV_ESTIMATORS.get(algo.adv_estimator)
        adv = torch.zeros(mask.shape)
        adv[own] = estimator(rewards, groups, mask[own], norm_by_std=algo.norm_by_std)
        of = {(samples[i].group_id, samples[i].index): i for i in own}
        for i, s in enumerate(samples):
            if s.episode_of is not None:
                j = of[(s.group_id, s.episode_of)]
                adv[i] = (adv[j] * mask[j]).sum() / mask[j].sum().clamp(min=1) * mask[i]
    return adv


def advantage_metrics(adv: Tensor, mask: Tensor) -> dict[str, float]:
    """adv, mask (B, R) -> critic/advantages/{mean,max,min} over the tokens trained on, as verl
    reports them; {} when there are none."""
    valid = adv[mask > 0]
    if not valid.numel():
        return {}
    return {
        "critic/advantages/mean": float(valid.mean()),
        "critic/advantages/max": float(valid.max()),
        "critic/advantages/min": float(valid.min()),
    }
