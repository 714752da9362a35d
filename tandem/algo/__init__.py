"""RL algorithm pieces as small pure tensor functions in registries (no Ray, no engine).

ADV_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, LOSS_AGGS and CORRECTIONS map names to functions; `.get(name)`
raises TandemError listing the valid names. Shapes and formulas are in each function's docstring.
"""

from tandem.algo.advantages import (
    ADV_ESTIMATORS,
    drgrpo_advantages,
    gae,
    gae_advantages,
    group_stats,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from tandem.algo.aggregate import (
    LOSS_AGGS,
    active_seqs,
    aggregate,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from tandem.algo.corrections import (
    CORRECTIONS,
    apply_corrections,
    interpolate_prox_logp,
    mismatch_metrics,
    old_logprob_source,
)
from tandem.algo.entropy import entropy_from_logits
from tandem.algo.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from tandem.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from tandem.algo.policy_loss import POLICY_LOSSES, gspo_loss, ppo_clip_loss

__all__ = [
    "ADV_ESTIMATORS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "active_seqs",
    "aggregate",
    "apply_corrections",
    "drgrpo_advantages",
    "entropy_from_logits",
    "gae",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "gspo_loss",
    "interpolate_prox_logp",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "old_logprob_source",
    "ppo_clip_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]
