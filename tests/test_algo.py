"""tandem.algo against values computed by hand (written as literals), plus the invariants a trainer
relies on: aggregates add up across micro-batches, padding never leaks, bad names list valid ones."""

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algo import (
    ADV_ESTIMATORS,
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_AGGS,
    POLICY_LOSSES,
    aggregate,
    entropy_from_logits,
    masked_mean,
    masked_whiten,
)
from tandem.algo.corrections import apply_corrections
from tandem.errors import TandemError
from tandem.registry import OptionRegistry, Registry

T = torch.tensor


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- advantages -----------------------------------------------------------------------------------


def test_grpo_one_group():
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> ±0.5 / 0.57735 = ±0.866025
    adv = ADV_ESTIMATORS.get("grpo")(T([1.0, 0, 0, 1]), T([0, 0, 0, 0]), torch.ones(4, 2))
    close(adv, [[0.866025] * 2, [-0.866025] * 2, [-0.866025] * 2, [0.866025] * 2])


def test_grpo_groups_by_id_and_singletons_get_zero():
    # groups {7: [2, 0]}, {3: [1, 1, 4]}, {9: [5]}: means 1 and 2, stds sqrt(2) and sqrt(3)
    rewards, ids = T([2.0, 1, 0, 1, 4, 5]), T([7, 3, 7, 3, 3, 9])
    adv = ADV_ESTIMATORS.get("grpo")(rewards, ids, torch.ones(6, 1), eps=0.0)
    close(adv[:, 0], [0.707107, -0.577350, -0.707107, -0.577350, 1.154701, 0.0])
    # a constant group with eps=0 is 0 / 0: advantage 0, not nan
    close(ADV_ESTIMATORS.get("grpo")(T([1.0, 1.0]), T([0, 0]), torch.ones(2, 1), eps=0.0), [[0.0], [0.0]])


def test_grpo_without_std_and_drgrpo_are_centred_rewards():
    rewards, ids, mask = T([1.0, 0, 0, 1]), T([0, 0, 1, 1]), torch.ones(4, 1)
    expected = [[0.5], [-0.5], [-0.5], [0.5]]
    close(ADV_ESTIMATORS.get("grpo")(rewards, ids, mask, norm_by_std=False), expected)
    # drgrpo ignores norm_by_std=True: the trainer passes the same kwargs to every estimator
    close(ADV_ESTIMATORS.get("drgrpo")(rewards, ids, mask, norm_by_std=True), expected)


def test_rloo():
    # A_0 = 1 - (0 + 0 + 1) / 3 = 0.6667, A_1 = 0 - 2/3; group {2.0} alone -> 0
    adv = ADV_ESTIMATORS.get("rloo")(T([1.0, 0, 0, 1, 2]), T([0, 0, 0, 0, 1]), torch.ones(5, 1))
    close(adv[:, 0], [0.666667, -0.666667, -0.666667, 0.666667, 0.0])


def test_reinforce_plus_plus_whitens_over_masked_tokens():
    # tokens 1,1,1,0,0: mean 0.6, unbiased var (3·0.16 + 2·0.36) / 4 = 0.3, std 0.547723
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv = ADV_ESTIMATORS.get("reinforce_plus_plus")(T([1.0, 0.0]), T([0, 1]), mask)
    close(adv, [[0.730297, 0.730297, 0.730297], [-1.095445, -1.095445, 0.0]])


def test_reinforce_plus_plus_baseline():
    # centred: [0.5, -0.5, 0, 0]; tokens .5,.5,-.5,0,0: mean 0.1, var 0.7/4 = 0.175, std 0.418330
    mask = T([[1, 1], [1, 0], [1, 1], [0, 0]])
    adv = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline")(T([1.0, 0, 0.5, 0.5]), T([0, 0, 1, 1]), mask)
    close(adv, [[0.956183, 0.956183], [-1.434274, 0.0], [-0.239046, -0.239046], [0.0, 0.0]])


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_every_estimator_takes_the_same_call_and_zeroes_padding(name):
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    critic = {"values": torch.full((4, 3), 0.5)} if name == "gae" else {}  # a critic's estimator
    adv = ADV_ESTIMATORS.get(name)(T([1, 0, 3, 2]), T([0, 0, 1, 1]), mask, norm_by_std=True, **critic)
    assert adv.shape == (4, 3) and adv.dtype.is_floating_point
    assert torch.isfinite(adv).all() and (adv[mask == 0] == 0).all()


def test_estimator_rejects_misaligned_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        ADV_ESTIMATORS.get("grpo")(T([1.0, 0.0]), T([0, 0, 0]), torch.ones(2, 2))


# --- policy loss ----------------------------------------------------------------------------------


def _ppo(ratios: list[float], advs: list[float], **kw):
    ratio = T([ratios])
    old = torch.full_like(ratio, -1.0)
    return POLICY_LOSSES.get("ppo_clip")(old + ratio.log(), old, T([advs]), torch.ones_like(ratio), **kw)


def test_ppo_clip_asymmetric():
    # clip range [0.8, 1.28]. A=+1, r=1.5 -> -1.28 (clipped); A=+1, r=0.5 -> -0.5;
    # A=-1, r=0.5 -> 0.8 (clipped); A=-1, r=1.5 -> 1.5; A=+1, r=1.25 -> -1.25 (inside clip-high)
    loss, m = _ppo([1.5, 0.5, 0.5, 1.5, 1.25], [1, 1, -1, -1, 1], clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.28, -0.5, 0.8, 1.5, -1.25]])
    close(m["pg_clipfrac"], [[1.0, 0, 1, 0, 0]])
    close(m["pg_clipfrac_lower"], [[0.0, 0, 0, 0, 0]])
    close(m["ppo_kl"], [[-0.405465, 0.693147, 0.693147, -0.405465, -0.223144]])


def test_ppo_clip_symmetric_clips_what_clip_higher_lets_through():
    loss, m = _ppo([1.25], [1.0])
    close(loss, [[-1.2]])
    close(m["pg_clipfrac"], [[1.0]])


def test_ppo_dual_clip():
    # clip_c = 3: A=-1, r=5 -> min(5, 3) = 3 (dual bound); A=-1, r=2 -> 2; A=+1, r=5 -> -1.2 untouched
    loss, m = _ppo([5.0, 2.0, 5.0], [-1, -1, 1], clip_c=3.0)
    close(loss, [[3.0, 2.0, -1.2]])
    close(m["pg_clipfrac_lower"], [[1.0, 0, 0]])
    close(m["pg_clipfrac"], [[0.0, 0, 1]])


def test_ppo_masks_garbage_padding():
    logp, old = T([[-1.0, float("nan")]]), T([[-1.0, 5.0]])
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, old, T([[2.0, 2.0]]), T([[1, 0]]))
    close(loss, [[-2.0, 0.0]])
    assert all(torch.isfinite(v).all() for v in m.values())


def test_ppo_gradient_on_policy_is_minus_advantage():
    # at ratio 1 nothing is clipped and d(-A·ratio)/d logp = -A: the plain policy gradient
    logp = T([[-0.5, -2.0, -1.0]], requires_grad=True)
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, logp.detach(), T([[2.0, -3.0, 7.0]]), T([[1, 1, 0]]))
    loss.sum().backward()
    close(logp.grad, [[-2.0, 3.0, 0.0]])


@pytest.mark.parametrize("bad", [{"clip_c": 1.0}, {"clip_c": 0.5}, {"clip_low": 1.0}, {"clip_high": -0.1}])
def test_ppo_rejects_bad_clip(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _ppo([1.0], [1.0], **bad)


# --- KL and entropy -------------------------------------------------------------------------------


def test_kl_estimators():
    logp, ref = T([0.0, -1.0]), T([-1.0, 0.0])
    close(KL_ESTIMATORS.get("k1")(logp, ref), [1.0, -1.0])
    close(KL_ESTIMATORS.get("k2")(logp, ref), [0.5, 0.5])
    # d = ref - logp = [-1, 1]: e^-1 + 1 - 1 = 0.367879; e - 1 - 1 = 0.718282
    close(KL_ESTIMATORS.get("k3")(logp, ref), [0.367879, 0.718282])


def test_kl_aliases_and_k3_clamp():
    assert KL_ESTIMATORS.get("kl") is KL_ESTIMATORS.get("k1")
    assert KL_ESTIMATORS.get("mse") is KL_ESTIMATORS.get("k2")
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")
    close(KL_ESTIMATORS.get("k3")(T([0.0]), T([30.0])), [10.0])


def test_entropy_from_logits():
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), 0.0, 0.0]]])
    # uniform over 4: ln 4 = 1.386294; probs [1, 3, 1, 1] / 6
    close(entropy_from_logits(logits), [[1.386294, 1.242453]])
    # shifting the logits far out changes nothing (no overflow in exp)
    close(entropy_from_logits(logits.double() + 1000.0), [[1.386294, 1.242453]])


# --- masked helpers -------------------------------------------------------------------------------


def test_masked_mean_and_whiten():
    x, mask = T([[1.0, 3.0, float("inf")], [5.0, 0.0, 0.0]]), T([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 3.0)
    close(masked_mean(x, mask, dim=-1), [2.0, 5.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)
    # values 1, 3, 5: mean 3, unbiased std 2
    close(masked_whiten(x, mask, eps=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    close(masked_whiten(T([2.0, 2.0]), T([1, 1]), eps=0.0), [0.0, 0.0])


# --- aggregation ----------------------------------------------------------------------------------

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
RAGGED = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10 / 4),  # (1+2+3+4) / 4 tokens
        ("seq-mean-token-sum", 10 / 2),  # (6 + 4) / 2 rows with tokens
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / (2 * 3)),  # / (rows · T)
    ],
)
def test_aggregation_modes(mode, expected):
    close(aggregate(mode, LOSS, RAGGED), expected)


def test_aggregation_global_counts_and_empty_batch():
    close(aggregate("token-mean", LOSS, RAGGED, global_tokens=8), 10 / 8)
    close(aggregate("seq-mean-token-sum-norm", LOSS, RAGGED, global_seqs=4, norm_len=5), 10 / 20)
    for mode in LOSS_AGGS.names():
        close(aggregate(mode, LOSS, torch.zeros_like(RAGGED)), 0.0)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=2, max_size=8),
    split=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_micro_batches_sum_to_the_mini_batch(lengths, split, seed):
    split = min(split, len(lengths) - 1)
    width = 6
    loss = torch.randn(
        len(lengths), width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    mask = (torch.arange(width)[None, :] < T(lengths)[:, None]).float()
    counts = {"global_tokens": mask.sum(), "global_seqs": (mask.sum(-1) > 0).sum(), "norm_len": width}
    for mode in LOSS_AGGS.names():
        full = aggregate(mode, loss, mask, **counts)
        # each micro-batch is trimmed to its own longest response, as a token-budget packer would
        parts = []
        for rows in (slice(0, split), slice(split, None)):
            t = max(int(mask[rows].sum(-1).max()), 1)
            parts.append(aggregate(mode, loss[rows, :t], mask[rows, :t], **counts))
        torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-12, atol=1e-12)


# --- registries -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "registry, known",
    [(ADV_ESTIMATORS, "grpo"), (POLICY_LOSSES, "ppo_clip"), (KL_ESTIMATORS, "k3"), (LOSS_AGGS, "token-mean")],
)
def test_unknown_name_lists_valid_names(registry, known):
    with pytest.raises(TandemError, match=rf"{registry.kind}.*Valid names:.*{known}"):
        registry.get("no-such-thing")


def test_expected_names_registered():
    assert ADV_ESTIMATORS.names() == [
        "drgrpo",
        "gae",
        "grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "rloo",
    ]
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "kl", "low_var_kl", "mse"]
    assert LOSS_AGGS.names() == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]


# --- options: the trainer's context may go unused, anything else must be declared ------------------

_M = torch.ones(2, 3)
# Each option registry's entries, called as the trainer calls them: positional tensors, then context.
TRAINER_CALLS = [
    (ADV_ESTIMATORS, (T([1.0, 0.0]), T([0, 0]), _M), {"norm_by_std": True}),
    (POLICY_LOSSES, (-_M, -_M, _M, _M), {"clip_low": 0.2, "clip_high": 0.28, "clip_c": None}),
    (LOSS_AGGS, (_M, _M), {"global_tokens": 6.0, "global_seqs": 2.0, "norm_len": 3.0}),
    (CORRECTIONS, (-_M, -_M, -_M, _M, _M), {"cap": 2.0, "low": 0.5, "high": 2.0, "delta": 1e-4}),
]


@pytest.mark.parametrize(
    "registry, args, context, name",
    [pytest.param(r, a, c, n, id=n) for r, a, c in TRAINER_CALLS for n in r.names()],
)
def test_every_entry_takes_the_trainers_context(registry, args, context, name):
    assert set(context) == registry.context
    critic = {"values": torch.zeros(args[2].shape)} if name == "gae" else {}  # the critic's call adds them
    registry.get(name)(*args, **context, **critic)


@pytest.mark.parametrize(
    "registry, args, name, typo, pattern",
    [
        (
            POLICY_LOSSES,
            TRAINER_CALLS[1][1],
            "ppo_clip",
            {"clip_hgh": 0.3},
            r"Policy loss 'ppo_clip' has no option 'clip_hgh'. Its options: clip_low, clip_high, clip_c\.",
        ),
        (POLICY_LOSSES, TRAINER_CALLS[1][1], "gspo", {"cliplow": 3e-4}, r"'gspo' has no option 'cliplow'"),
        (
            ADV_ESTIMATORS,
            TRAINER_CALLS[0][1],
            "grpo",
            {"norm_by_sd": False},
            r"Advantage estimator 'grpo' has no option 'norm_by_sd'. Its options: norm_by_std, eps",
        ),
        (
            ADV_ESTIMATORS,
            TRAINER_CALLS[0][1],
            "rloo",
            {"eps": 0.0},
            r"'rloo' has no option 'eps'. Its options: none \(it also accepts and ignores norm_by_std\)",
        ),
        (LOSS_AGGS, TRAINER_CALLS[2][1], "token-mean", {"global_token": 6.0}, r"no option 'global_token'"),
        (
            CORRECTIONS,
            TRAINER_CALLS[3][1],
            "tis",
            {"caps": 2.0},
            r"Correction 'tis' has no option 'caps'.*cap",
        ),
    ],
    ids=["ppo_clip", "gspo", "grpo", "rloo", "token-mean", "tis"],
)
def test_a_misspelled_option_is_an_error_naming_entry_option_and_valid_ones(
    registry, args, name, typo, pattern
):
    with pytest.raises(TandemError, match=pattern):
        registry.get(name)(*args, **typo)


def test_misspelled_options_fail_through_the_combinators():
    with pytest.raises(TandemError, match="'tis' has no option 'cap_'"):
        apply_corrections(["tis"], -_M, -_M, -_M, _M, _M, cap_=2.0)


def test_an_entry_taking_kwargs_is_refused_at_registration():
    registry = OptionRegistry("thing", context=["a"])
    with pytest.raises(ValueError, match=r"'loose' takes \*\*kwargs"):

        @registry.register("loose")
        def loose(x, **_):
            return x


def test_an_entry_declares_its_traits_and_gets_the_defaults_for_the_rest():
    @dataclass(frozen=True)
    class Traits:
        fast: bool = False
        cost: int = 1

    registry = OptionRegistry("thing", traits=Traits)
    registry.register("quick", fast=True)(lambda x: x)
    registry.register("plain")(lambda x: x)
    assert registry.traits("quick") == Traits(fast=True, cost=1)
    assert registry.traits("plain") == Traits()
    with pytest.raises(TandemError, match=r"Unknown thing 'nope'. Valid names: plain, quick"):
        registry.traits("nope")
    with pytest.raises(ValueError, match=r"'slow' declares \['speed'\], not traits of its registry"):
        registry.register("slow", speed=0)


def test_a_registry_of_values_has_no_traits():
    registry = Registry("spec")
    registry.register("a")(3)  # an entry may be a value (rollout.engines registers EngineSpecs)
    assert registry.get("a") == 3 and registry.traits("a") is None
    with pytest.raises(ValueError, match=r"'b' declares traits \['x'\]; its registry has no traits"):
        registry.register("b", x=1)


def test_the_registries_declare_what_the_rest_of_tandem_asks():
    def having(registry, trait):
        return [n for n in registry.names() if getattr(registry.traits(n), trait)]

    assert having(ADV_ESTIMATORS, "needs_critic") == ["gae"]
    assert having(CORRECTIONS, "weights") == ["decoupled", "icepop", "mis", "seq_mask_tis", "seq_tis", "tis"]
    assert having(CORRECTIONS, "masks") == ["icepop", "mis", "opsm", "seq_mask_tis"]
    assert having(CORRECTIONS, "old_is_behaviour") == ["bypass"]
    assert having(CORRECTIONS, "old_is_prox") == ["decoupled"]
    assert having(CORRECTIONS, "reads_theta") == ["opsm"]
    assert POLICY_LOSSES.traits("gspo").defaults == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert POLICY_LOSSES.traits("ppo_clip").defaults == {}


def test_cispo_weights_the_logprob_gradient_by_the_clipped_detached_ratio():
    """Hand-computed: ratios 2.0 (clipped to 1.28), 0.5 (clipped to 0.8) and 1.1 (kept); the loss
    is -w·A·logp and its gradient -w·A, so the clipped tokens keep a gradient (ppo_clip's would be 0)."""
    old = torch.log(torch.tensor([[0.25, 0.4, 0.5, 0.3]]))
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.55, 0.9]])).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, diag = POLICY_LOSSES.get("cispo")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    w = torch.tensor([1.28, 0.8, 1.1, 0.0])
    expected = -w * adv[0] * torch.log(torch.tensor([0.5, 0.2, 0.55, 0.9])) * mask[0]
    torch.testing.assert_close(loss[0], expected)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad[0], -w * adv[0] * mask[0])
    assert diag["pg_clipfrac"][0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert diag["pg_clipfrac_lower"][0].tolist() == [0.0, 1.0, 0.0, 0.0]
    ppo, _ = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    logp.grad = None
    ppo.sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0  # where ppo_clip drops the clipped tokens
