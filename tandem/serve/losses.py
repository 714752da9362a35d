"""The Tinker SDK's built-in losses, one registry entry each. An entry's traits say what the service
checks before a request is queued: the loss_fn_inputs a datum must carry (`needs`) and may carry
(`reads`), its loss_fn_config check (`config`: the values with their defaults, or a TandemError
naming the key), and whether its datums must name recorded samples (`provenance`).

Tinker's losses are sums over every target position of every datum (no mean: the client scales
its weights or advantages). logp is the trainer's logprob of each target, q the sampler's (the
datum's `logprobs`), A its `advantages`, r = exp(logp - q), sg[] a stop-gradient; lo and hi are
loss_fn_config's clip_low_threshold and clip_high_threshold, ratio bounds around 1:

    cross_entropy        -w · logp                          w = `weights`, 1 where not given
    importance_sampling  -r · A
    ppo                  -min(r·A, clip(r, lo, hi)·A)        lo, hi = 0.8, 1.2
    cispo                -sg[clip(r, lo, hi)] · A · logp     lo, hi = 0, 4: one-sided by default
    dro                  -(A·logp - ½·beta·(logp - q)²)      beta: required (Tinker's docs use 0.05)
    gspo                 ppo's objective, every token's ratio s_t = sg[s]·exp(logp - sg[logp]) where
                         log s = mean of (logp - q) over M = `sequence_ratio_mask` != 0 (s = 1 for an
                         empty M); lo, hi = 1 - 3e-4, 1 + 4e-4 (tandem.algo's gspo: the paper's)
    stable_reinforce     -sg[min(r, 1)]·A·logp + kl_coeff·(r - 1 - log r) at the sampled targets, 0
                         elsewhere; q recorded at sampling; kl_coeff = 0

The formulas are those of Tinker's loss pages (losses, losses/gspo) and of the cookbook's
202_loss_functions tutorial, which gives cispo's one-sided default; the defaults of dro's beta and
gspo's bounds are not given there, hence beta required and the GSPO paper's range. Every ratio's log
is clamped to ±20 as tandem.algo's losses clamp theirs, except importance_sampling's (Tinker's
formula, unclamped, as before).

stable_reinforce: Tinker documents its sampling records (a sampler made with
record_stability_info=True; each training datum naming its sampled sequences by provenance spans,
`check_provenance`), but the part of its page giving the objective could not be read here, so the
objective is tandem's under that name: REINFORCE on the sampled tokens, the importance weight
detached and truncated at 1 (a token the trainer now finds likelier than the sampler did is not
up-weighted), plus kl_coeff times the k3 estimate of KL(sampler ‖ trainer), with q what the sampler
recorded. Where the sampler's and the trainer's logprobs agree bit for bit (run.deterministic=true:
the engine scores as the trainer does), r = 1 exactly: the weight is 1, the KL term is 0 and so is
its gradient ((r - 1)·∇logp), and the loss is plain on-policy REINFORCE, -A·logp, whose gradient
-A·∇logp is importance_sampling's at r = 1.

Every function: logp (B, T) and the datums' inputs {name: (B, T)}, config -> loss (B, T), 0 past each
datum's end (the caller masks).
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.algo import KL_ESTIMATORS, POLICY_LOSSES, masked_mean
from tandem.errors import TandemError
from tandem.registry import Registry
from tandem.serve.wire import Datum, Span

Config = Mapping[str, float | str]
ConfigCheck = Callable[[Config], dict[str, float]]
LossFn = Callable[[Tensor, dict[str, Tensor], Config], Tensor]
_LOG_CLAMP = 20.0  # as tandem.algo's: one far-off logprob must not overflow exp()
RL = ("logprobs", "advantages")
SAMPLED = "sampled_mask"  # set by check_provenance, never by a client: 1 at the targets sampled spans cover


@dataclass(frozen=True)
class Option:
    """One loss_fn_config key: its default (None: the client must give it) and the rule its value
    keeps, as a test and as words for the refusal."""

    default: float | None
    ok: Callable[[float], bool]
    rule: str


def config_check(loss: str, **options: Option) -> ConfigCheck:
    """The check of `loss`'s loss_fn_config: config -> every option's value (its default where not
    given), or a TandemError naming the key that is unknown, missing or out of its rule."""

    def check(config: Config) -> dict[str, float]:
        unknown = sorted(set(config) - set(options))
        if unknown:
            keys = ", ".join(options) or "none"
            raise TandemError(f"Loss {loss!r} takes no loss_fn_config {unknown}; its keys: {keys}.")
        values = {}
        for name, option in options.items():
            value = config.get(name, option.default)
            if value is None:
                raise TandemError(f"Loss {loss!r} needs loss_fn_config[{name!r}], a number {option.rule}.")
            if isinstance(value, str) or not math.isfinite(value) or not option.ok(value):
                raise TandemError(
                    f"loss_fn_config[{name!r}]={value!r} of loss {loss!r} must be a number {option.rule}."
                )
            values[name] = float(value)
        return values

    return check


def _ratio_bounds(loss: str, low: float, high: float, low_may_be_0: bool = False) -> ConfigCheck:
    """Tinker's clip_low_threshold / clip_high_threshold: ratio bounds around 1."""
    low_ok = (lambda v: 0 <= v <= 1) if low_may_be_0 else (lambda v: 0 < v <= 1)
    return config_check(
        loss,
        clip_low_threshold=Option(low, low_ok, "in [0, 1]" if low_may_be_0 else "in (0, 1]"),
        clip_high_threshold=Option(high, lambda v: v >= 1, ">= 1"),
    )


@dataclass(frozen=True)
class TinkerLoss:
    needs: tuple[str, ...] = ()  # loss_fn_inputs every datum carries besides target_tokens
    reads: tuple[str, ...] = ()  # loss_fn_inputs a datum may carry besides those
    config: ConfigCheck = config_check("this")  # loss_fn_config -> its values, or a TandemError
    provenance: bool = False  # datums name the sampled sequences they train on (check_provenance)


LOSSES: Registry[LossFn] = Registry("Tinker loss", traits=TinkerLoss)

_ppo_config = _ratio_bounds("ppo", 0.8, 1.2)
_cispo_config = _ratio_bounds("cispo", 0.0, 4.0, low_may_be_0=True)
_GSPO = POLICY_LOSSES.traits("gspo").defaults  # the paper's clip range, as distances from 1
_gspo_config = _ratio_bounds("gspo", 1.0 - _GSPO["clip_low"], 1.0 + _GSPO["clip_high"])
_dro_config = config_check("dro", beta=Option(None, lambda v: v >= 0, ">= 0"))
_stable_config = config_check("stable_reinforce", kl_coeff=Option(0.0, lambda v: v >= 0, ">= 0"))


def _log_ratio(logp: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    return (logp - inputs["logprobs"]).clamp(-_LOG_CLAMP, _LOG_CLAMP)


@LOSSES.register("cross_entropy", reads=("weights",), config=config_check("cross_entropy"))
def cross_entropy(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """-weights · logp; weights default to 1 at every position."""
    weights = inputs.get("weights", torch.ones_like(logp))
    return -weights * logp


@LOSSES.register("importance_sampling", needs=RL, config=config_check("importance_sampling"))
def importance_sampling(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """-exp(logp - q) · A: the policy gradient of samples drawn from q, unclipped."""
    return -torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]


def _ppo_clip(logp: Tensor, q: Tensor, adv: Tensor, bounds: dict[str, float]) -> Tensor:
    """tandem.algo's ppo_clip with q as the old logprobs and Tinker's ratio bounds (lo, hi) as its
    distances from 1 (clip_low = 1 - lo, clip_high = hi - 1)."""
    low, high = bounds["clip_low_threshold"], bounds["clip_high_threshold"]
    loss, _ = POLICY_LOSSES.get("ppo_clip")(
        logp, q, adv, torch.ones_like(adv), clip_low=1.0 - low, clip_high=high - 1.0
    )
    return loss


@LOSSES.register("ppo", needs=RL, config=_ppo_config)
def ppo(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """-min(r·A, clip(r, lo, hi)·A): tandem.algo's ppo_clip with q as the old logprobs."""
    return _ppo_clip(logp, inputs["logprobs"], inputs["advantages"], _ppo_config(config))


@LOSSES.register("cispo", needs=RL, config=_cispo_config)
def cispo(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """-sg[clip(r, lo, hi)] · A · logp. Written out rather than tandem.algo's cispo, which keeps its
    lower bound above 0: Tinker's default has none (clip_low_threshold 0)."""
    bounds = _cispo_config(config)
    weight = torch.exp(_log_ratio(logp, inputs).detach())
    weight = weight.clamp(bounds["clip_low_threshold"], bounds["clip_high_threshold"])
    return -weight * inputs["advantages"] * logp


@LOSSES.register("dro", needs=RL, config=_dro_config)
def dro(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """-(A·logp - beta·k2(logp, q)), k2 = ½(logp - q)²: DRO's quadratic penalty is tandem.algo's k2."""
    beta = _dro_config(config)["beta"]
    penalty = KL_ESTIMATORS.get("k2")(logp, inputs["logprobs"])
    return -(inputs["advantages"] * logp - beta * penalty)


@LOSSES.register("gspo", needs=(*RL, "sequence_ratio_mask"), config=_gspo_config)
def gspo(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """GSPO-token as ppo_clip with the old logprobs sg[logp] - log s: then logp - old has the value
    log s and the gradient ∇logp, so every token's ratio is s_t = sg[s]·exp(logp - sg[logp]). The
    ratio's positions M come from `sequence_ratio_mask`; the loss counts every position, as Tinker's."""
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_s = masked_mean(logp.detach() - inputs["logprobs"], in_ratio, dim=-1)  # (B,)
    old = logp.detach() - log_s[:, None]  # (B, T)
    return _ppo_clip(logp, old, inputs["advantages"], _gspo_config(config))


@LOSSES.register("stable_reinforce", needs=RL, config=_stable_config, provenance=True)
def stable_reinforce(logp: Tensor, inputs: dict[str, Tensor], config: Config) -> Tensor:
    """(-sg[min(r, 1)]·A·logp + kl_coeff·(r - 1 - log r)) at the sampled targets (SAMPLED), 0
    elsewhere; r - 1 - log r is tandem.algo's k3 with q as the policy and logp as the reference: the
    estimate of KL(sampler ‖ trainer) on the sampler's tokens. The module docstring says why, and what
    it is when r = 1."""
    if SAMPLED not in inputs:
        raise TandemError("stable_reinforce's datums reached the trainer without check_provenance.")
    kl_coeff = _stable_config(config)["kl_coeff"]
    weight = torch.exp(_log_ratio(logp, inputs).detach()).clamp(max=1.0)
    kl = KL_ESTIMATORS.get("k3")(inputs["logprobs"], logp)
    loss = -weight * inputs["advantages"] * logp + kl_coeff * kl
    return torch.where(inputs[SAMPLED] != 0, loss, 0.0)


def check_request(loss_fn: str, config: Config, input_names: list[set[str]]) -> None:
    """A forward_backward's loss, its config and each datum's input names, before it is queued:
    TandemError (a 400 for the client) naming what is wrong."""
    loss = LOSSES.traits(loss_fn)  # lists the valid names
    loss.config(config)
    known = sorted({*loss.needs, *loss.reads})
    for i, names in enumerate(input_names):
        missing = [n for n in loss.needs if n not in names]
        if missing:
            raise TandemError(f"Datum {i}: loss {loss_fn!r} needs loss_fn_inputs {missing}.")
        unknown = sorted(names - set(known))
        if unknown:
            raise TandemError(f"Datum {i}: unknown loss_fn_inputs {unknown}; {loss_fn!r} reads {known}.")
        if names != input_names[0]:  # the trainer pads each input across the request's datums
            raise TandemError(
                f"Datum {i} carries loss_fn_inputs {sorted(names)}, datum 0 {sorted(input_names[0])}: "
                "give every datum of a request the same ones."
            )


@dataclass(frozen=True)
class Recorded:
    """One sampled sequence as the service keeps it when its sample request set
    record_stability_info: the request's prompt, the sampled tokens, and the sampler's logprob of
    each as the response sent it (float32)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def check_provenance(datums: list[Datum], recorded: Mapping[str, Recorded], loss_fn: str) -> list[Datum]:
    """A forward_backward's datums against the sequences its session recorded -> the datums to train.

    Every span must name a recorded sequence, stay within its prompt or sampled tokens, and claim
    exactly the tokens recorded there; a `provenance` loss's datums must all carry spans. Those
    datums come back with `logprobs` taken from the records wherever a sampled span covers a target,
    and SAMPLED (1 there, 0 elsewhere) among their inputs. A breach is a TandemError naming the datum
    and the sequence. Call it after `check_request`, which refuses SAMPLED from a client."""
    needed = LOSSES.traits(loss_fn).provenance
    out = []
    for i, d in enumerate(datums):
        if d.target_spans is None:
            if needed:
                raise TandemError(
                    f"Datum {i}: loss {loss_fn!r} trains on recorded samples: sample with "
                    "record_stability_info=True and give each datum its provenance "
                    "(Datum.with_provenance, naming each run's SampledSequence.sequence_id)."
                )
            out.append(d)
            continue
        _check_spans(i, "model_input", d.input_spans or [], d.tokens, recorded)
        _check_spans(i, "loss_fn_inputs", d.target_spans, d.targets, recorded)
        out.append(_with_records(d, recorded) if needed else d)
    return out


def _check_spans(
    i: int, field: str, spans: list[Span], tokens: list[int], recorded: Mapping[str, Recorded]
) -> None:
    at = 0
    for span in spans:
        record = recorded.get(span.sequence_id)
        if record is None:
            raise TandemError(
                f"Datum {i}: a {field} provenance span names sequence {span.sequence_id!r}, which this "
                "session never recorded (sample it with record_stability_info=True, in this session)."
            )
        source, what = (record.tokens, "sampled tokens") if span.sampled else (record.prompt, "prompt")
        end = span.offset + span.length
        if end > len(source):
            raise TandemError(
                f"Datum {i}: a {field} span claims positions [{span.offset}, {end}) of the {what} of "
                f"{span.sequence_id!r}, which has {len(source)}."
            )
        if tokens[at : at + span.length] != source[span.offset : end]:
            raise TandemError(
                f"Datum {i}: {field} positions [{at}, {at + span.length}) are not the {what} "
                f"[{span.offset}, {end}) recorded for {span.sequence_id!r}."
            )
        at += span.length


def _with_records(d: Datum, recorded: Mapping[str, Recorded]) -> Datum:
    """The datum with the recorded logprobs wherever a sampled loss_fn_inputs span covers a target,
    and SAMPLED marking those targets."""
    logprobs, sampled, at = list(d.inputs["logprobs"]), [0.0] * len(d.targets), 0
    for span in d.target_spans or []:
        if span.sampled:
            record = recorded[span.sequence_id]
            logprobs[at : at + span.length] = record.logprobs[span.offset : span.offset + span.length]
            sampled[at : at + span.length] = [1.0] * span.length
        at += span.length
    return dataclasses.replace(d, inputs={**d.inputs, "logprobs": logprobs, SAMPLED: sampled})
