"""KL estimators: per-token estimates of KL(π ‖ π_ref) from the two logprobs of the sampled token.

Every estimator: fn(logp (B, T), ref_logp (B, T)) -> (B, T). Names follow Schulman's "Approximating
KL divergence" (k1, k2, k3) with verl's aliases (kl, mse, low_var_kl).
"""

from collections.abc import Callable

import torch
from torch import Tensor

from tandem.registry import Registry

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
@KL_ESTIMATORS.register("kl")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp (B, T) -> (B, T). k1 = logp - ref_logp; unbiased, but negative on some tokens."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
@KL_ESTIMATORS.register("mse")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp (B, T) -> (B, T). k2 = 0.5 · (logp - ref_logp)^2; biased, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
@KL_ESTIMATORS.register("low_var_kl")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp (B, T) -> (B, T). k3 = exp(d) - d - 1 with d = ref_logp - logp; unbiased, >= 0.

    d is clamped to [-20, 20] and k3 to [-10, 10], as in verl, because exp(d) explodes on tokens
    the reference model finds far likelier than the policy does.
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
