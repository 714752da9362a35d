"""PPO with a critic: GAE and the clipped value loss against hand-computed values, the value model,
and a critic that fits its returns; the policy's trainer takes the critic's advantages."""

import pytest
import torch
from helpers import logit_tolerance, on_gloo_ranks, random_samples, tiny_config, tiny_model, train_worker

from tandem.algo import ADV_ESTIMATORS, gae, masked_whiten
from tandem.config import AlgoConfig, TrainConfig
from tandem.errors import TandemError
from tandem.train.critic import CriticWorker, explained_variance, value_loss, value_model


def test_gae_matches_a_hand_computation():
    """γ = 0.9, λ = 0.8. Row 0: V = (0.5, 0.2, 0.1), r = 1 on the last token:
    δ2 = 1 - 0.1 = 0.9                  A2 = 0.9
    δ1 = 0.9·0.1 - 0.2 = -0.11          A1 = -0.11 + 0.72·0.9 = 0.538
    δ0 = 0.9·0.2 - 0.5 = -0.32          A0 = -0.32 + 0.72·0.538 = 0.06736
    Row 1: one token, V = 0.3, r = 0, and a padding value (99) that must not leak: A0 = -0.3."""
    rewards = torch.tensor([1.0, 0.0])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.06736, 0.538, 0.9], [-0.3, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.56736, 0.738, 1.0], [0.0, 0.0, 0.0]]))


def test_gae_carries_value_and_advantage_across_masked_tokens():
    """A tool's output inside a response (mask 0) is not a step of the episode: the row of the hand
    computation above with a masked token (value 7, which must not leak) after its first token has
    the same advantages on its own tokens, and 0 on the masked one."""
    rewards = torch.tensor([1.0])
    values = torch.tensor([[0.5, 7.0, 0.2, 0.1, 99.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.06736, 0.0, 0.538, 0.9, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.56736, 0.0, 0.738, 1.0, 0.0]]))


def test_gae_over_random_masks_is_gae_over_the_masked_in_tokens():
    """GAE's definition, written out on each row's masked-in tokens alone, against `gae`."""
    torch.manual_seed(0)
    rewards, values = torch.randn(6), torch.randn(6, 9)
    mask = (torch.rand(6, 9) > 0.4).float()
    mask[0] = 0.0  # an empty response
    adv, _ = gae(rewards, values, mask, gamma=0.95, lam=0.7)
    for row in range(6):
        steps = mask[row].nonzero().flatten().tolist()
        expected, next_adv, next_value = torch.zeros(9), 0.0, 0.0
        for i, t in reversed(list(enumerate(steps))):
            r = float(rewards[row]) if i == len(steps) - 1 else 0.0
            delta = r + 0.95 * next_value - float(values[row, t])
            next_adv, next_value = delta + 0.95 * 0.7 * next_adv, float(values[row, t])
            expected[t] = next_adv
        torch.testing.assert_close(adv[row], expected)


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    rewards = torch.tensor([2.0])
    values = torch.tensor([[0.5, -1.0, 0.25, 3.0]])
    adv, returns = gae(rewards, values, torch.ones(1, 4))
    torch.testing.assert_close(adv, 2.0 - values)
    torch.testing.assert_close(returns, torch.full((1, 4), 2.0))


def test_the_gae_estimator_whitens_over_the_batch():
    rewards, values = torch.tensor([1.0, 0.0]), torch.tensor([[0.5, 0.2], [0.1, 0.4]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    got = ADV_ESTIMATORS.get("gae")(rewards, torch.tensor([0, 1]), mask, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(got, masked_whiten(gae(rewards, values, mask, 0.9, 0.8)[0], mask))


def test_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    """V = 1.0 from V_old = 0.2 with c = 0.5 clips to 0.7: max((1.0-0.9)², (0.7-0.9)²) = 0.04, L = 0.02.
    V = 0.3 from V_old = 0.2 is inside the range: L = ½(0.3-0.9)² = 0.18. Token mean: 0.1."""
    vpred, old = torch.tensor([[1.0, 0.3]]), torch.tensor([[0.2, 0.2]])
    returns, mask = torch.tensor([[0.9, 0.9]]), torch.ones(1, 2)
    counts = dict(global_tokens=2.0, global_seqs=1.0, norm_len=2.0)
    loss, stats = value_loss(vpred, old, returns, mask, 0.5, "token-mean", counts)
    assert float(loss) == pytest.approx(0.1)
    assert stats["critic/vf_clipfrac"] == pytest.approx(0.5)


def test_explained_variance():
    returns, mask = torch.tensor([[1.0, 2.0, 4.0]]), torch.ones(1, 3)
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(explained_variance(torch.full((1, 3), 7.0), returns, mask)) == pytest.approx(0.0, abs=1e-6)


def critic(lr: float = 3e-3, strategy: str = "ddp") -> CriticWorker:
    train = TrainConfig(lr=lr, dtype="float32", strategy=strategy)
    return CriticWorker(value_model(tiny_model()), AlgoConfig(), train, 0, vf_clip=10.0, gamma=1.0, lam=1.0)


def test_a_fresh_value_head_predicts_zero_and_the_critic_fits_its_returns():
    worker = critic()
    samples = random_samples(4, 4)
    assert worker.values(samples).abs().max() == 0  # zero-initialised head
    first = worker.estimate(samples)
    assert all(len(s.token_advantages) == len(s.response_ids) for s in samples)
    losses = [worker.train_step(samples)["critic/vf_loss"]]
    for _ in range(30):
        worker.estimate(samples)
        losses.append(worker.train_step(samples)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert first["critic/values/mean"] == 0.0
    metrics = worker.train_step(samples) if worker.estimate(samples) else None
    assert metrics["critic/vf_explained_var"] > 0.3


def test_train_step_needs_the_batch_estimate_saw():
    worker = critic()
    samples = random_samples(2, 2)
    with pytest.raises(RuntimeError, match="estimate"):
        worker.train_step(samples)


def test_the_policy_trains_on_the_critics_advantages():
    samples = random_samples(2, 3)
    policy = train_worker(tiny_model(), dict(adv_estimator="gae"), dict(dtype="float32"))
    with pytest.raises(TandemError, match="no advantages from the critic"):
        policy.train_step(samples)
    critic().estimate(samples)
    metrics = policy.train_step(samples)
    mask = torch.zeros(len(samples), max(len(s.response_ids) for s in samples))
    for i, s in enumerate(samples):
        mask[i, : len(s.response_ids)] = 1
    assert [s.advantage for s in samples] == pytest.approx(
        [sum(s.token_advantages) / len(s.token_advantages) for s in samples]
    )
    assert metrics["critic/advantages/max"] == pytest.approx(max(max(s.token_advantages) for s in samples))


def test_a_resumed_critic_continues_bit_for_bit(tmp_path):
    from tandem.train.state import CRITIC, load_state, save_state

    samples = random_samples(3, 2)
    worker = critic()
    worker.estimate(samples)
    worker.train_step(samples)
    save_state(worker, tmp_path, CRITIC)
    worker.estimate(samples)
    worker.train_step(samples)
    expected = worker.values(samples)
    resumed = critic()
    load_state(resumed, tmp_path, CRITIC)
    assert resumed.version == 1
    resumed.estimate(samples)
    resumed.train_step(samples)
    assert torch.equal(resumed.values(samples), expected)


def critic_rank_step(strategy: str) -> dict:
    """One critic rank's estimate and train step -> what it computed."""
    worker = critic(strategy=strategy)
    worker.parallelize(torch.distributed.group.WORLD)
    samples = random_samples(4, 4)
    estimated = worker.estimate(samples)
    metrics = worker.train_step(samples)
    return {
        "estimated": estimated,
        "metrics": metrics,
        "advantages": [s.token_advantages for s in samples],
        "values": worker.values(samples),
    }


@pytest.mark.integration  # a gloo process group of two
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_critic_ranks_equal_one_critic(strategy):
    """The critic shards like the policy's trainers: two ranks give one worker's values, advantages,
    loss and (after the update) values, to float noise."""
    ranks = on_gloo_ranks(2, critic_rank_step, strategy)
    single = critic()
    samples = random_samples(4, 4)
    single.estimate(samples)
    metrics = single.train_step(samples)
    after = single.values(samples)
    for r in ranks:
        for got, want in zip(r["advantages"], [s.token_advantages for s in samples], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/grad_norm"):
            assert r["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
        # The head starts at zero, so its first Adam step (lr·sign(g), g far from 0) is all that
        # moved: the values then differ by the rounding of a forward to a one-output head, not more.
        # A rank stepping on its own half's gradient moves them by ~4e-2.
        torch.testing.assert_close(r["values"], after, atol=logit_tolerance(after, tiny_config()), rtol=0)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_run_with_a_critic_logs_its_metrics_and_resumes_with_it(tmp_path):
    import json

    from tandem.runtime.run import run_training
    from tandem.runtime.startup import load_config

    tiny = [
        "run.progress=false",
        "run.val_every=0",
        "run.save_every=1",
        "rollout.batch_size=4",
        "rollout.n=4",
        "data.val_size=8",
        "data.train_size=200",
        "reward.num_workers=1",
        "algo.adv_estimator=gae",
        "train.num_workers=2",  # two critic ranks too, sharded, in a world of their own
        "train.strategy=fsdp2",
        f"run.out_dir={tmp_path}",
    ]
    run_training(load_config(None, [*tiny, "run.steps=2"]))
    critic_state = tmp_path / "default" / "checkpoints" / "step_2" / "critic"
    assert (critic_state / "rank_0.pt").is_file() and (critic_state / "rank_1.pt").is_file()  # two ranks
    run_training(load_config(None, [*tiny, "run.steps=3", "run.resume=auto"]))
    lines = (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "critic/vf_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("critic/vf_explained_var", "critic/values/mean", "critic/returns/mean", "critic/vf_clipfrac"):
        assert key in steps[-1]
    assert steps[0]["critic/values/mean"] == 0.0 and steps[-1]["critic/values/mean"] != 0.0
