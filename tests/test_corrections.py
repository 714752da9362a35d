"""Off-policy corrections against values computed by hand (written as literals), their identity when
μ == π_old, the GSPO loss, and the trainer with each correction on: same loss for any micro-batch
split, the pg loss over the reduced mask, and no recompute pass where a correction replaces it."""

import functools
import math

import pytest
import torch
from helpers import assert_same_gradients, clone_model, grads, random_samples, tiny_model, train_worker

from tandem.algo import (
    CORRECTIONS,
    POLICY_LOSSES,
    apply_corrections,
    interpolate_prox_logp,
    mismatch_metrics,
    old_logprob_source,
)
from tandem.errors import TandemError
from tandem.runtime.startup import load_config
from tandem.sample import Sample
from tandem.train.advantages import advantages
from tandem.train.batch import pad_rows
from tandem.train.worker import MiniBatch, TrainWorker

T = torch.tensor


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# π_old/μ per token; the last token of row 1 is padding whose garbage ratio must never count.
RATIO = T([[0.25, 1.0, 3.0], [1.5, 0.4, 9.9]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
MU = torch.zeros(2, 3)
OLD = RATIO.log()
NEG = -torch.ones(2, 3)


def run(name: str, logp=OLD, old=OLD, mu=MU, adv=NEG, mask=MASK, **options):
    return CORRECTIONS.get(name)(logp, old, mu, adv, mask, **options)


def test_tis_caps_the_token_ratio():
    w, m, metrics = run("tis", cap=2.0)
    close(w, [[0.25, 1.0, 2.0], [1.5, 0.4, 0.0]])
    assert torch.equal(m, MASK)
    assert metrics == {"correction/tis_clipfrac": pytest.approx(1 / 5)}  # only the 3.0


def test_seq_tis_takes_the_product_over_masked_tokens():
    # products 0.25·1·3 = 0.75 and 1.5·0.4 = 0.6 (with the padding's 9.9 it would be 5.94 -> 2)
    w, _, metrics = run("seq_tis", cap=2.0)
    close(w, [[0.75] * 3, [0.6, 0.6, 0.0]])
    assert metrics["correction/seq_tis_clipfrac"] == 0.0
    w, _, metrics = run("seq_tis", cap=0.7)
    close(w, [[0.7] * 3, [0.6, 0.6, 0.0]])
    assert metrics["correction/seq_tis_clipfrac"] == pytest.approx(3 / 5)  # the tokens of row 0
    w, _, _ = run("seq_tis", cap=None)
    close(w, [[0.75] * 3, [0.6, 0.6, 0.0]])


@pytest.mark.parametrize("name", ["mis", "icepop"])
def test_mis_masks_tokens_outside_the_bounds(name):
    w, m, metrics = run(name, low=0.5, high=2.0)
    close(w, [[0.0, 1.0, 0.0], [1.5, 0.0, 0.0]])
    close(m, [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert metrics == {"correction/mis_maskfrac": pytest.approx(3 / 5)}  # 0.25, 3.0 and 0.4


def test_seq_mask_tis_masks_by_the_geometric_mean_then_applies_token_tis():
    # geometric means: 0.75^(1/3) = 0.9086 (kept), 0.6^(1/2) = 0.7746 (< 0.8: dropped)
    w, m, metrics = run("seq_mask_tis", cap=2.0, low=0.8, high=2.0)
    close(w, [[0.25, 1.0, 2.0], [0.0, 0.0, 0.0]])
    close(m, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert metrics["correction/seq_mask_tis_maskfrac"] == pytest.approx(2 / 5)
    assert metrics["correction/seq_mask_tis_clipfrac"] == pytest.approx(1 / 5)
    _, m, _ = run("seq_mask_tis", low=0.5, high=0.9)  # 0.9086 > 0.9: row 0 dropped instead
    close(m, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])


def test_opsm_masks_only_negative_sequences_that_drifted():
    old = torch.zeros(4, 2)
    # mean_t log(π_old/π_θ) per row: 0.05, 0.05, 0.00005, 0.05 (row 3's garbage padding excluded)
    logp = T([[-0.1, 0.0], [-0.1, 0.0], [-0.0001, 0.0], [-0.05, -100.0]])
    adv = T([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [-0.5, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    w, m, metrics = CORRECTIONS.get("opsm")(logp, old, old, adv, mask, delta=1e-4)
    # row 0: A < 0 and drift 0.05 > δ -> dropped; row 1: A > 0 -> kept; row 2: drift 5e-5 <= δ -> kept
    close(m, [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    close(w, m)
    assert metrics == {"correction/opsm_maskfrac": pytest.approx(3 / 7)}
    _, m, _ = CORRECTIONS.get("opsm")(logp, old, old, adv, mask, delta=0.1)
    assert torch.equal(m, mask)


def test_decoupled_weights_by_prox_over_behaviour_and_bypass_is_the_identity():
    w, m, metrics = run("decoupled", cap=2.0)  # old_logp is π_prox here
    close(w, [[0.25, 1.0, 2.0], [1.5, 0.4, 0.0]])
    assert metrics == {"correction/decoupled_clipfrac": pytest.approx(1 / 5)}
    w, _, metrics = run("decoupled", cap=None)
    close(w, [[0.25, 1.0, 3.0], [1.5, 0.4, 0.0]])
    assert metrics["correction/decoupled_clipfrac"] == 0.0
    w, m, metrics = run("bypass")
    assert torch.equal(w, MASK) and torch.equal(m, MASK) and metrics == {}


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_every_correction_is_the_identity_when_behaviour_equals_old(name):
    logp = T([[-0.3, -1.2, -0.7], [-2.0, -0.1, float("nan")]])  # nan: padding garbage
    w, m, metrics = CORRECTIONS.get(name)(logp, logp, logp.clone(), NEG, MASK)
    assert torch.equal(w, MASK), name  # weight 1 on the mask, 0 off it
    assert torch.equal(m, MASK), name
    assert all(v == 0.0 for v in metrics.values()), metrics


def test_combined_corrections_multiply_weights_and_and_masks():
    logp = OLD - T([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])  # row 1 drifted: opsm drops it (A < 0)
    w, m, metrics = apply_corrections(["tis", "opsm"], logp, OLD, MU, NEG, MASK, cap=2.0, delta=1e-4)
    close(w, [[0.25, 1.0, 2.0], [0.0, 0.0, 0.0]])
    close(m, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert metrics == {
        "correction/tis_clipfrac": pytest.approx(1 / 5),
        "correction/opsm_maskfrac": pytest.approx(2 / 5),
    }
    w, m, _ = apply_corrections(["tis", "mis"], OLD, OLD, MU, NEG, MASK, cap=2.0, low=0.5, high=2.0)
    close(w, [[0.0, 1.0, 0.0], [2.25, 0.0, 0.0]])  # 1.5 (tis) · 1.5 (mis) on the one kept token
    close(m, [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w, m, metrics = apply_corrections([], OLD, OLD, MU, NEG, MASK)
    assert torch.equal(w, MASK) and torch.equal(m, MASK) and metrics == {}
    with pytest.raises(TandemError, match="correction.*Valid names:.*opsm"):
        apply_corrections(["nope"], OLD, OLD, MU, NEG, MASK)


def test_weights_are_detached():
    logp = OLD.clone().requires_grad_()
    old = OLD.clone().requires_grad_()
    for name in CORRECTIONS.names():
        w, _, _ = CORRECTIONS.get(name)(logp, old, MU, NEG, MASK)
        assert not w.requires_grad, name
    w, _, _ = apply_corrections(CORRECTIONS.names(), logp, old, MU, NEG, MASK)
    assert not w.requires_grad


def test_interpolated_prox_logp_at_known_versions():
    mu, theta = T([[-1.0, -2.0, -3.0]]), T([[-1.5, -2.5, -3.5]]).requires_grad_()
    # v_μ = 0, v_prox = 1, v_θ = 2: α = 1/2
    out = interpolate_prox_logp(mu, theta, T([[0, 0, 0]]), prox_version=1, theta_version=2)
    close(out, [[-1.25, -2.25, -3.25]])
    assert not out.requires_grad
    # per-token versions: α = (3 - 0)/(4 - 0) = 0.75, (3 - 2)/(4 - 2) = 0.5, v_μ = v_prox: 0,
    # v_μ = v_θ: 0 (no span), unknown version (-1): 0
    mu, theta = T([[-1.0, -2.0, -1.0, -1.0, -1.0]]), T([[-1.5, -2.2, -3.0, -3.0, -3.0]])
    out = interpolate_prox_logp(mu, theta, T([[0, 2, 3, 4, -1]]), prox_version=3, theta_version=4)
    close(out, [[-1.375, -2.1, -1.0, -1.0, -1.0]])


def test_old_logprob_source():
    assert old_logprob_source([]) == "recompute"
    assert old_logprob_source(["tis", "opsm"]) == "recompute"
    assert old_logprob_source(["bypass", "opsm"]) == "behaviour"
    assert old_logprob_source(["decoupled"], "recompute") == "recompute"
    assert old_logprob_source(["decoupled"], "interpolate") == "interpolate"


def test_mismatch_metrics():
    old, mu, mask = T([[math.log(2.0), 0.0, 5.0]]), T([[0.0, 0.0, -9.0]]), T([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(old, mu, mask)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(0.693147, abs=1e-6)
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.346574, abs=1e-6)
    assert m["mismatch/ratio_mean"] == pytest.approx(1.5, abs=1e-6)  # (2 + 1) / 2
    assert m["mismatch/kl"] == pytest.approx(0.153426, abs=1e-6)  # ((2 - 1 - ln 2) + 0) / 2
    same = mismatch_metrics(old, old, mask)
    assert same["mismatch/kl"] == 0.0 and same["mismatch/logprob_abs_diff_max"] == 0.0
    assert same["mismatch/ratio_mean"] == 1.0
    assert all(v == 0.0 for v in mismatch_metrics(old, mu, torch.zeros(1, 3)).values())


# --- GSPO -------------------------------------------------------------------------------------------


def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    old = T([[-1.0, -2.0, -0.5]])
    logp = (old + T([[0.1, -0.3, 50.0]])).requires_grad_()  # the third token is masked out
    mask = T([[1.0, 1.0, 0.0]])
    loss, m = POLICY_LOSSES.get("gspo")(logp, old, T([[1.0, 1.0, 1.0]]), mask, clip_low=0.2, clip_high=0.2)
    s = math.exp(-0.1)  # exp(mean(0.1, -0.3)) = 0.904837: inside [0.8, 1.2]
    close(loss, [[-s, -s, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[-s, -s, 0.0]])  # token-level stop-gradient form: s_i · ∇logp_t
    close(m["pg_clipfrac"], [[0.0, 0.0, 0.0]])
    close(m["ppo_kl"], [[-0.1, 0.3, 0.0]])


def test_gspo_clips_whole_sequences_at_its_tight_defaults():
    old = T([[-1.0, -2.0]])
    logp = (old + T([[0.1, -0.3]])).requires_grad_()
    # A < 0, s = 0.9048 < 1 - 3e-4: the clipped term 0.9997 is larger, so it is taken and the
    # gradient is 0 for every token of the sequence
    loss, m = POLICY_LOSSES.get("gspo")(logp, old, T([[-1.0, -1.0]]), torch.ones(1, 2))
    close(loss, [[1 - 3e-4, 1 - 3e-4]])
    close(m["pg_clipfrac"], [[1.0, 1.0]])
    loss.sum().backward()
    close(logp.grad, [[0.0, 0.0]])


def test_gspo_ignores_garbage_padding():
    old = T([[-1.0, float("nan")]])
    logp = T([[-1.0, float("-inf")]], requires_grad=True)
    loss, _ = POLICY_LOSSES.get("gspo")(logp, old, T([[2.0, 2.0]]), T([[1.0, 0.0]]))
    close(loss, [[-2.0, 0.0]])
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("log_ratio", [-25.0, -3.0, 0.1, 3.0, 19.0, 25.0])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_gspo_on_one_token_sequences_is_ppo_clip_in_value_and_gradient(log_ratio, adv):
    """A one-token sequence's ratio is its token's, so the two losses must agree, beyond the ±20
    clamp too: there ppo_clip's clamp passes no gradient, and neither may GSPO's."""
    old = T([[-30.0]])
    out = {}
    for name in ("ppo_clip", "gspo"):
        logp = (old + log_ratio).requires_grad_()
        loss, _ = POLICY_LOSSES.get(name)(
            logp, old, T([[adv]]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28
        )
        loss.sum().backward()
        out[name] = (loss.detach(), logp.grad)
    torch.testing.assert_close(out["gspo"], out["ppo_clip"], rtol=1e-6, atol=0)


def test_gspo_sequence_beyond_the_clamp_gets_no_gradient():
    old = T([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    # row 0: mean log-ratio 30 (> 20, clamped); row 1: 0.5, inside. A < 0, so neither is clipped.
    logp = (old + T([[20.0, 40.0, 30.0], [0.5, 0.5, 0.5]])).requires_grad_()
    loss, _ = POLICY_LOSSES.get("gspo")(logp, old, -torch.ones(2, 3), torch.ones(2, 3))
    close(loss[0], [math.exp(20.0)] * 3, atol=1e-3 * math.exp(20.0))  # the clamped value
    loss.sum().backward()
    close(logp.grad, [[0.0, 0.0, 0.0], [math.exp(0.5)] * 3])


@pytest.mark.parametrize(
    "overrides, low, high",
    [
        (["algo.policy_loss=gspo"], 3e-4, 4e-4),
        (["algo.policy_loss=gspo", "algo.clip_low=0.001"], 0.001, 4e-4),
        (["algo.policy_loss=gspo", "algo.clip_high=0.2"], 3e-4, 0.2),
        (["algo.clip_high=0.2", "algo.policy_loss=gspo"], 3e-4, 0.2),
        (["algo.policy_loss=ppo_clip"], 0.2, 0.28),
        ([], 0.2, 0.28),
    ],
)
def test_gspo_brings_its_own_clip_range_unless_one_is_set(overrides, low, high):
    algo = load_config(None, overrides).algo
    assert (algo.clip_low, algo.clip_high) == (low, high)


def test_gspo_clip_range_set_in_a_recipe_is_kept(tmp_path):
    (tmp_path / "r.yaml").write_text("algo:\n  policy_loss: gspo\n  clip_high: 0.01\n")
    algo = load_config(tmp_path / "r.yaml").algo
    assert (algo.clip_low, algo.clip_high) == (3e-4, 0.01)


# --- config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.corrections=[tis,nope]"], r"'algo.corrections' is 'nope'.*Valid names: bypass, decoupled"),
        (["algo.corrections=[bypass,decoupled]"], r"combines bypass with decoupled"),
        (["algo.corrections=[bypass,tis]"], r"combines bypass with tis"),
        (["algo.corrections=[tis,mis]"], r"combines tis, mis.*twice"),
        (["algo.corrections=[opsm,opsm]"], r"names one twice"),
        (["algo.prox_logprob=interpolate"], r"'algo.prox_logprob'.*add decoupled"),
        (["algo.prox_logprob=cached"], r"'algo.prox_logprob' is 'cached'.*recompute, interpolate"),
        (["algo.mis_low=1.5"], r"'algo.mis_low'.*mis_low <= 1 <= mis_high"),
        (["algo.correction_cap=0"], r"'algo.correction_cap' must be > 0"),
        (["algo.opsm_delta=-1"], r"'algo.opsm_delta' must be >= 0"),
    ],
)
def test_bad_correction_config(overrides, expected):
    with pytest.raises(TandemError, match=expected):
        load_config(None, overrides)


def test_good_correction_configs_load():
    for overrides in (
        ["algo.corrections=[tis,opsm]", "algo.correction_cap=null"],
        ["algo.corrections=[bypass,opsm]"],
        ["algo.corrections=[decoupled,opsm]", "algo.prox_logprob=interpolate"],
        ["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4"],
    ):
        load_config(None, overrides)


# --- the trainer ------------------------------------------------------------------------------------

CASES = [
    dict(corrections=["tis", "opsm"]),
    dict(corrections=["mis"], mis_low=0.8, mis_high=1.25),
    dict(corrections=["seq_mask_tis"], mis_low=0.9, mis_high=1.1),
    dict(corrections=["seq_tis"], policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    dict(corrections=["decoupled", "opsm"], prox_logprob="interpolate"),
    dict(corrections=["bypass", "opsm"]),
]


def worker(model, budget: int = 10_000, mini_batch_size: int = 0, **algo) -> TrainWorker:
    w = train_worker(model, algo, dict(lr=1e-3, micro_batch_tokens=budget, mini_batch_size=mini_batch_size))
    w.version = 2  # tokens were sampled at version 0: two versions stale, so interpolation moves
    return w


@functools.cache
def stale_samples() -> list[Sample]:
    """μ = the test model's logprobs plus noise (an engine a little off the trainer), not random."""
    samples = random_samples(4, 4)
    logp = train_worker(tiny_model()).compute_logprobs(samples)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0)) * 0.15
    for s, row in zip(samples, logp + noise, strict=True):
        s.logprobs = row[: len(s.response_ids)].tolist()
    return samples


@pytest.mark.parametrize("algo", CASES, ids=lambda a: "+".join(a["corrections"]))
def test_micro_batches_give_the_single_batch_loss_and_gradients_with_corrections(algo):
    model, samples = tiny_model(), stale_samples()
    whole = worker(model, mini_batch_size=8, kl_coef=0.1, entropy_coef=0.01, **algo)
    split = worker(clone_model(model), budget=24, mini_batch_size=8, kl_coef=0.1, entropy_coef=0.01, **algo)
    # Two updates, so the second one's π_θ differs from π_old (opsm needs its own forward there).
    # SGD: Adam's first step is about lr·sign(g), which turns float noise in a gradient that is 0
    # in exact arithmetic into a real weight difference, and the second update would inherit it.
    for w in (whole, split):
        w.learner.optimizer = torch.optim.SGD(w.model.parameters(), lr=0.5)
        w.learner.scheduler = torch.optim.lr_scheduler.LambdaLR(w.learner.optimizer, lambda _: 1.0)
    m_whole, m_split = whole.train_step(samples), split.train_step(samples)
    assert m_whole.keys() == m_split.keys()
    assert any(k.startswith("correction/") for k in m_whole) or algo["corrections"] == ["seq_tis"]
    for key in (k for k in m_whole if not k.startswith("timing_s/")):  # wall times differ, of course
        assert m_whole[key] == pytest.approx(m_split[key], rel=1e-5, abs=1e-6), key
    assert_same_gradients(grads(split.model), grads(whole.model), model, samples)


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_train_step_runs_with_each_correction(name):
    corrections = [name]
    prox = "interpolate" if name == "decoupled" else "recompute"
    w = worker(tiny_model(), mini_batch_size=8, corrections=corrections, prox_logprob=prox)
    metrics = w.train_step(stale_samples())
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    recomputed = w.old_source == "recompute"
    assert ("mismatch/kl" in metrics) == recomputed  # no π_old to compare μ with otherwise
    if recomputed:
        assert metrics["mismatch/kl"] >= 0 and metrics["mismatch/logprob_abs_diff_max"] > 0
    expected = CORRECTIONS.get(name)(*[torch.zeros(1, 1)] * 5)[2].keys()
    assert expected <= metrics.keys()


def test_pg_loss_is_weighted_and_divided_by_the_tokens_the_corrections_keep():
    model, samples = tiny_model(), stale_samples()
    for names in (["mis"], ["tis"], ["seq_mask_tis"]):
        w = worker(clone_model(model), corrections=names, mis_low=0.9, mis_high=1.1)
        old = w.compute_logprobs(samples)
        mask = pad_rows([s.loss_mask for s in samples], old.shape[1])
        mu = pad_rows([s.logprobs for s in samples], old.shape[1])
        adv = advantages(samples, mask, w.algo)
        weight, kept, _ = apply_corrections(names, old, old, mu, adv, mask, low=0.9, high=1.1)
        assert 0 < kept.sum() < mask.sum() or names == ["tis"]
        # one update, so π_θ = π_old and the PPO ratio is 1: loss = Σ_kept -A·w / N_kept
        expected = float((-adv * weight * kept).sum() / kept.sum())
        assert w.train_step(samples)["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6), names


def count_recomputes(w: TrainWorker) -> list[int]:
    calls = []
    inner = w.compute_logprobs
    w.compute_logprobs = lambda samples, model=None: calls.append(len(samples)) or inner(samples, model)
    return calls


@pytest.mark.parametrize(
    "algo, expected",
    [
        (dict(), [16]),  # the step's recompute of π_old
        (dict(corrections=["bypass"]), []),  # π_old = μ: no forward pass
        (dict(corrections=["decoupled"], prox_logprob="interpolate"), []),  # π_prox from μ and π_θ
        (dict(corrections=["opsm"]), [16]),  # first update: π_θ is the recomputed π_old
        (dict(corrections=["opsm"], mini_batch_size=8), [16, 8]),  # the second update needs π_θ
        (dict(corrections=["bypass", "opsm"]), [16]),  # no π_old recompute, but opsm needs π_θ
    ],
)
def test_forward_passes_before_the_update(algo, expected):
    w = worker(tiny_model(), **algo)
    calls = count_recomputes(w)
    w.train_step(stale_samples())
    assert calls == expected


def test_bypass_uses_behaviour_logprobs_as_old():
    w = worker(tiny_model(), corrections=["bypass"])
    mu = T([[-0.5, -1.0]])
    assert w._old_logprobs(w.old_source, None, mu, torch.zeros(1, 2), None) is mu
    # π_θ ≠ μ, so the first update's PPO ratio is not 1 and the clip acts on some tokens
    metrics = w.train_step(random_samples(2, 4))
    assert metrics["actor/pg_clipfrac"] > 0


def test_corrections_need_behaviour_logprobs_of_every_token():
    samples = random_samples(1, 2)
    samples[1].logprobs = samples[1].logprobs[:-1]
    with pytest.raises(TandemError, match=r"engine's logprob of every response token; sample 0/1"):
        worker(tiny_model(), corrections=["tis"]).train_step(samples)
    samples = random_samples(1, 2)
    samples[0].versions = []
    with pytest.raises(TandemError, match=r"policy version of every response token; sample 0/0"):
        worker(tiny_model(), corrections=["decoupled"], prox_logprob="interpolate").train_step(samples)


def test_opsm_mask_reads_the_current_policy_after_the_first_update():
    samples = stale_samples()
    w = worker(tiny_model(), corrections=["opsm"], opsm_delta=1e-3)
    width = max(len(s.response_ids) for s in samples)
    mask = pad_rows([s.loss_mask for s in samples], width)
    mu = pad_rows([s.logprobs for s in samples], width)
    adv = advantages(samples, mask, w.algo)
    batch = MiniBatch(
        samples, torch.arange(len(samples)), mask, adv, mu, torch.zeros_like(mask), old=mu, ref=None
    )  # a stale π_old
    # first update after a recompute: π_θ is π_old, so nothing drifted
    assert torch.equal(w._pg_mask(batch, first=True), mask)
    theta = w.compute_logprobs(samples)
    _, expected, _ = apply_corrections(["opsm"], theta, mu, mu, adv, mask, delta=1e-3)
    assert 0 < expected.sum() < mask.sum()
    assert torch.equal(w._pg_mask(batch, first=False), expected)
