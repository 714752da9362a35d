"""The Tinker SDK's built-in losses, as per-token functions the service's trainer sums.

Tinker's losses are sums over every target position of every datum (no mean: the client scales
its weights or advantages), with the ratio taken against the sampler's logprobs μ it sends:

    cross_entropy        -w · logp                                           inputs: weights (default 1)
    importance_sampling  -exp(logp - μ) · A                                  inputs: logprobs, advantages
    ppo                  ppo_clip (tandem.algo) with the ratio's bounds [low, high] from
                         loss_fn_config clip_low_threshold / clip_high_threshold (default 0.8, 1.2)
    cispo                cispo (tandem.algo), the same bounds

ppo and cispo are tandem's own policy losses (`tandem.algo.POLICY_LOSSES`) with old_logp = μ;
Tinker's thresholds are ratio bounds, tandem's clip_low / clip_high distances from 1. Every
function: logp (B, T) and the datums' inputs {name: (B, T)}, config -> loss (B, T), 0 past each
datum's end (the caller masks).
"""

from collections.abc import Callable

import torch
from torch import Tensor

from tandem.algo import POLICY_LOSSES
from tandem.errors import TandemError
from tandem.registry import Registry

LossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float | str]], Tensor]
LOSSES: Registry[LossFn] = Registry("Tinker loss")
# The loss_fn_inputs each loss reads besides target_tokens (a missing one is a bad request).
NEEDS = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}


@LOSSES.register("cross_entropy")
def cross_entropy(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    """-weights · logp; weights default to 1 at every position."""
    weights = inputs.get("weights", torch.ones_like(logp))
    return -weights * logp


@LOSSES.register("importance_sampling")
def importance_sampling(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    """-exp(logp - μ) · A: the policy gradient of samples drawn from μ, unclipped."""
    return -torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]


def _bounds(config: dict) -> dict[str, float]:
    """Tinker's ratio bounds -> tandem's clip_low / clip_high (distances from 1)."""
    low, high = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    if not 0 < low <= 1 <= high:
        raise TandemError(
            f"clip_low_threshold={low} and clip_high_threshold={high} must satisfy 0 < low <= 1 <= high."
        )
    return {"clip_low": 1.0 - low, "clip_high": high - 1.0}


@LOSSES.register("ppo")
def ppo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    adv = inputs["advantages"]
    loss, _ = POLICY_LOSSES.get("ppo_clip")(
        logp, inputs["logprobs"], adv, torch.ones_like(adv), **_bounds(config)
    )
    return loss


@LOSSES.register("cispo")
def cispo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    adv = inputs["advantages"]
    loss, _ = POLICY_LOSSES.get("cispo")(
        logp, inputs["logprobs"], adv, torch.ones_like(adv), **_bounds(config)
    )
    return loss


def check_request(loss_fn: str, config: dict, input_names: list[set[str]]) -> None:
    """A forward_backward's loss, its config and each datum's input names, before it is queued:
    TandemError (a 400 for the client) naming what is wrong."""
    LOSSES.get(loss_fn)  # lists the valid names
    if loss_fn in ("ppo", "cispo"):
        _bounds(config)
    known = {"weights", "logprobs", "advantages"}
    for i, names in enumerate(input_names):
        missing = [n for n in NEEDS[loss_fn] if n not in names]
        if missing:
            raise TandemError(f"Datum {i}: loss {loss_fn!r} needs loss_fn_inputs {missing}.")
        unknown = sorted(names - known)
        if unknown:
            raise TandemError(
                f"Datum {i}: unknown loss_fn_inputs {unknown}; {loss_fn!r} reads {sorted(known)}."
            )
