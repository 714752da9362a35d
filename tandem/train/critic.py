"""PPO's critic: a value model trained beside the policy, and the GAE advantages computed from it.

The value model is the policy's decoder with its LM head replaced by a value head (hidden -> 1,
zero-initialised, so every value starts at 0): V(s_t) is read at the position whose hidden state
predicts response token t, i.e. the state before the token is chosen. `estimate` computes the
values of a batch, then GAE's advantages and returns where the values are (algo.gamma, algo.lam)
and hands the whitened advantages to the policy's trainers in `Sample.token_advantages`;
`train_step` then fits the values to those returns with PPO's clipped value loss, on its own
optimizer. The worker is the value loss on a `Learner` of its own, the policy's kind: the same fp32
master weights and compute dtype, device, micro-batching, gradient clipping and resumable state.
"""

import copy
import time
from collections import defaultdict

import torch
from torch import Tensor, nn

from tandem.algo import aggregate, gae, masked_mean, masked_var, masked_whiten
from tandem.config import AlgoConfig, TrainConfig
from tandem.model.decoder import CausalLM
from tandem.sample import Sample
from tandem.train.batch import pad_rows
from tandem.train.learner import Learner, loss_counts


def value_model(policy: CausalLM) -> CausalLM:
    """The critic's network from the policy's: the same decoder, its LM head a zero-initialised
    value head (hidden -> 1). A forward without targets returns the values (B, T, 1) in fp32."""
    critic = copy.deepcopy(policy)
    head = nn.Linear(policy.cfg.hidden_size, 1, bias=False)
    nn.init.zeros_(head.weight)
    critic.lm_head = head.to(policy.lm_head.weight.device, policy.lm_head.weight.dtype)
    return critic


class CriticWorker:
    """Values, GAE and the value update. vf_clip: the clip range of the values around their old
    ones in the loss (verl's cliprange_value); gamma, lam: GAE's."""

    def __init__(
        self,
        model: CausalLM,
        algo: AlgoConfig,
        train: TrainConfig,
        pad_token_id: int,
        *,
        vf_clip: float,
        gamma: float,
        lam: float,
        total_updates: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        """model: the value model (`value_model`) in fp32; the rest as `TrainWorker`'s."""
        self.learner = Learner(model, train, pad_token_id, total_updates, seed, device, dtype)
        self.algo, self.cfg = algo, train
        self.vf_clip, self.gamma, self.lam = vf_clip, gamma, lam
        self.version = 0
        self._batch: tuple[list[Sample], Tensor, Tensor] | None = None  # (samples, values, returns)

    def parallelize(self, group) -> None:
        """Join the critic's data-parallel group, before the first step (`Learner.parallelize`)."""
        self.learner.parallelize(group)

    def values(self, samples: list[Sample]) -> Tensor:
        """V(s_t) of every response token -> (B, R_max), 0 past each response's end."""
        return self.learner.per_token(
            samples, lambda chunk, width: self._forward(self.learner.compute, chunk, width)
        )

    def _forward(self, model: nn.Module, samples: list[Sample], width: int) -> Tensor:
        """V(s_t) of the samples' response tokens under `model` -> (b, width)."""
        rows = self.learner.rows(samples)
        v = model(rows.ids, rows.positions, rows.mask).flatten()[rows.targets.index]  # (N,)
        return v.new_zeros(rows.size, width).index_put((rows.row, rows.col), v)

    def estimate(self, samples: list[Sample]) -> dict[str, float]:
        """Values, then GAE: sets each sample's `token_advantages` (whitened over the batch) and
        keeps the values and returns for the `train_step` that follows -> metrics."""
        start = time.perf_counter()
        values = self.values(samples)
        mask = _response_mask(samples, values.shape[1])
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
        raw, returns = gae(rewards, values, mask, self.gamma, self.lam)
        adv = masked_whiten(raw, mask)  # the `gae` estimator's result, GAE computed once for both
        for s, row in zip(samples, adv, strict=True):
            s.token_advantages = row[: len(s.response_ids)].tolist()
        self._batch = (samples, values, returns)
        return {
            "critic/values/mean": float(masked_mean(values, mask)),
            "critic/returns/mean": float(masked_mean(returns, mask)),
            "timing_s/values": time.perf_counter() - start,
        }

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Fit the values of the batch `estimate` saw to its returns -> metrics:

        L_V = 1/2 · max((V - G)², (clip(V, V_old - c, V_old + c) - G)²), aggregated as algo.loss_agg
        """
        if self._batch is None or [s.key for s in self._batch[0]] != [s.key for s in samples]:
            raise RuntimeError("CriticWorker.train_step needs estimate() on the same batch first")
        samples, old, returns = self._batch
        self._batch = None
        mask = pad_rows([s.loss_mask for s in samples], old.shape[1])
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        for _ in range(self.cfg.epochs):
            for rows in self.learner.mini_batches(len(samples)):
                for k, v in self._value_update(samples, rows, mask, old, returns).items():
                    sums[k] += v
                updates += 1
        self.version += 1
        metrics = {k: v / updates for k, v in sums.items()}
        metrics["critic/vf_explained_var"] = float(explained_variance(old, returns, mask))
        metrics["critic/lr"] = self.learner.scheduler.get_last_lr()[0]
        return metrics

    def _value_update(
        self, samples: list[Sample], rows: Tensor, mask: Tensor, old: Tensor, returns: Tensor
    ) -> dict[str, float]:
        chosen = [samples[i] for i in rows]
        m, v_old, g = mask[rows], old[rows], returns[rows]
        counts = loss_counts(m)

        def micro_loss(part: list[int]) -> tuple[Tensor, dict[str, float], None]:
            return self._value_micro_loss(chosen, part, m, v_old, g, counts)

        sums, _ = self.learner.accumulate(chosen, micro_loss)
        sums["critic/grad_norm"] = self.learner.step()
        return sums

    def _value_micro_loss(
        self, chosen: list[Sample], part: list[int], mask: Tensor, old: Tensor, returns: Tensor, counts: dict
    ) -> tuple[Tensor, dict[str, float], None]:
        """One micro-batch's share of the value loss and of the metrics (no output to hand back);
        an empty `part` is a dummy forward of row 0."""
        vpred = self._forward(self.learner.module, [chosen[i] for i in part or [0]], mask.shape[1])
        if not part:
            return vpred.sum() * 0.0, {}, None
        idx, device = torch.tensor(part), vpred.device
        old, returns, mask = old[idx].to(device), returns[idx].to(device), mask[idx].to(device)
        return *value_loss(vpred, old, returns, mask, self.vf_clip, self.algo.loss_agg, counts), None


def value_loss(
    vpred: Tensor, old: Tensor, returns: Tensor, mask: Tensor, clip: float, loss_agg: str, counts: dict
) -> tuple[Tensor, dict[str, float]]:
    """vpred, old, returns, mask (b, R) -> this micro-batch's share of the mini-batch's value loss,
    and its metric shares: L = 1/2 · max((V - G)², (clip(V, V_old ± c) - G)²) per token."""
    clipped = old + (vpred - old).clamp(-clip, clip)
    unclipped_loss, clipped_loss = (vpred - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    loss = aggregate(loss_agg, per_token, mask, **counts)
    tokens = max(counts["global_tokens"], 1.0)
    m = mask.bool()
    return loss, {
        "critic/vf_loss": float(loss.detach()),
        "critic/vf_clipfrac": float(((clipped_loss > unclipped_loss) & m).sum()) / tokens,
        "critic/vpred_mean": float(torch.where(m, vpred.detach(), 0.0).sum()) / tokens,
    }


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(G - V) / Var(G) over the masked tokens: 1 when the values predict the returns
    exactly, 0 when they explain nothing (a constant), negative when worse than a constant."""
    return 1 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)


def _response_mask(samples: list[Sample], width: int) -> Tensor:
    """1 at every response token (tool output too: GAE runs over the whole trajectory) -> (B, width)."""
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    return (torch.arange(width)[None, :] < lengths[:, None]).float()
