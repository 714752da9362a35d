"""The train worker: recompute logprobs, compute advantages, and update the policy.

One `train_step` is one RL step: π_old is recomputed for the batch, advantages come from the
rewards, then each mini-batch is split into micro-batches by a token budget and its gradients
accumulated, so the result does not depend on the split.
"""

import copy
import math
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import Tensor

from tandem.algo import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, aggregate, entropy_from_logits
from tandem.config import AlgoConfig, TrainConfig
from tandem.model import CausalLM, token_logprobs
from tandem.sample import Sample
from tandem.train.batch import Collated, collate, micro_batches, pad_rows, response_logits
from tandem.train.optim import make_optimizer, make_scheduler


class TrainWorker:
    def __init__(
        self,
        model: CausalLM,
        algo: AlgoConfig,
        train: TrainConfig,
        pad_token_id: int,
        temperature: float = 1.0,
        total_updates: int = 1,
        seed: int = 0,
        norm_len: int | None = None,
    ):
        self.model = model.train()
        self.algo, self.cfg = algo, train
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = next(model.parameters()).device
        # The reference policy is the initial one, frozen; it is only kept when a KL term needs it.
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if algo.kl_coef > 0 else None
        self.optimizer = make_optimizer(model, train.lr, train.betas, train.weight_decay)
        self.scheduler = make_scheduler(
            self.optimizer, train.warmup_steps, total_updates, train.schedule, train.min_lr_ratio
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.skipped_steps = 0
        # seq-mean-token-sum-norm divides by a constant length (Dr. GRPO); the longest response
        # allowed, when known, so the scale does not drift with each batch's longest response.
        self.norm_len = norm_len

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters by Hugging Face name, for weight sync and checkpoints."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def _forward(self, model: CausalLM, c: Collated) -> tuple[Tensor, Tensor]:
        """-> logp (b, R) of the response tokens, and the logits that predicted them (b, R, V)."""
        logits = response_logits(model, c)
        return token_logprobs(logits, c.resp_tokens, self.temperature), logits

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], model: CausalLM | None = None) -> Tensor:
        """Logprobs of every response token under `model` (default: the policy) -> (B, R_max)."""
        model = model or self.model
        width = max(max(len(s.response_ids) for s in samples), 1)
        out = torch.zeros(len(samples), width)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        for idx in micro_batches(lengths, self.cfg.micro_batch_tokens):
            c = collate([samples[i] for i in idx], self.pad_token_id, self.device)
            logp, _ = self._forward(model, c)
            out[idx, : logp.shape[1]] = logp.cpu() * c.resp_mask.cpu()
        return out

    def advantages(self, samples: list[Sample], mask: Tensor) -> Tensor:
        """(B, R) advantages from the samples' rewards and groups; also stored on each sample."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
        groups = torch.tensor([s.group_id for s in samples])
        estimator = ADV_ESTIMATORS.get(self.algo.adv_estimator)
        adv = estimator(rewards, groups, mask, norm_by_std=self.algo.norm_by_std)
        for s, row, m in zip(samples, adv, mask, strict=True):
            s.advantage = float((row * m).sum() / m.sum().clamp(min=1))
        return adv

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL update on a batch of finished, rewarded samples -> metrics."""
        width = max(max(len(s.response_ids) for s in samples), 1)
        mask = pad_rows([s.loss_mask for s in samples], width)
        behaviour = pad_rows([s.logprobs for s in samples], width)
        old = self.compute_logprobs(samples)
        ref = self.compute_logprobs(samples, self.ref_model) if self.ref_model is not None else None
        adv = self.advantages(samples, mask)
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        for _ in range(self.cfg.epochs):
            for rows in self._mini_batches(len(samples)):
                stats = self._update(
                    [samples[i] for i in rows],
                    old[rows],
                    ref[rows] if ref is not None else None,
                    adv[rows],
                    mask[rows],
                )
                for k, v in stats.items():
                    sums[k] += v
                updates += 1
        self.version += 1
        metrics = {k: v / updates for k, v in sums.items()}
        diff = (old - behaviour).abs()[mask > 0]
        metrics.update(
            {
                "actor/lr": self.scheduler.get_last_lr()[0],
                "actor/skipped_steps": float(self.skipped_steps),
                "mismatch/logprob_abs_diff_max": float(diff.max()) if diff.numel() else 0.0,
                "mismatch/logprob_abs_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
            }
        )
        return metrics

    def _mini_batches(self, n: int) -> list[Tensor]:
        size = self.cfg.mini_batch_size or n
        order = torch.randperm(n, generator=self.generator) if size < n else torch.arange(n)
        return [order[i : i + size] for i in range(0, n, size)]

    def _update(
        self, samples: list[Sample], old: Tensor, ref: Tensor | None, adv: Tensor, mask: Tensor
    ) -> dict[str, float]:
        """Accumulate gradients over micro-batches, then one optimizer step (or a counted skip)."""
        a = self.algo
        counts = dict(
            global_tokens=float(mask.sum()),
            global_seqs=float((mask.sum(-1) > 0).sum()),
            norm_len=float(self.norm_len or mask.shape[1]),
        )
        loss_fn = POLICY_LOSSES.get(a.policy_loss)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        for idx in micro_batches(lengths, self.cfg.micro_batch_tokens):
            c = collate([samples[i] for i in idx], self.pad_token_id, self.device)
            r = c.resp_mask.shape[1]
            m = mask[idx, :r].to(self.device)
            logp, logits = self._forward(self.model, c)
            # Entropy is always logged; it joins the graph only when it is part of the loss.
            entropy = entropy_from_logits((logits if a.entropy_coef else logits.detach()) / self.temperature)
            pg, stats = loss_fn(
                logp,
                old[idx, :r].to(self.device),
                adv[idx, :r].to(self.device),
                m,
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                clip_c=a.clip_c,
            )
            pg_loss = aggregate(a.loss_agg, pg, m, **counts)
            ent = aggregate(a.loss_agg, entropy, m, **counts)
            loss = pg_loss - a.entropy_coef * ent
            if ref is not None:
                kl = aggregate(
                    a.loss_agg,
                    KL_ESTIMATORS.get(a.kl_estimator)(logp, ref[idx, :r].to(self.device)),
                    m,
                    **counts,
                )
                loss = loss + a.kl_coef * kl
                sums["actor/kl_loss"] += float(kl.detach())
            loss.backward()
            sums["actor/pg_loss"] += float(pg_loss.detach())
            tokens = max(counts["global_tokens"], 1.0)  # per-token metrics: means over the mini-batch
            sums["actor/entropy"] += float((entropy.detach() * m).sum()) / tokens
            for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                if key in stats:
                    sums[f"actor/{key}"] += float((stats[key].detach() * m).sum()) / tokens
        sums["actor/grad_norm"] = self._optimizer_step()
        return sums

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if not math.isfinite(norm):
            # A NaN/inf gradient would poison the weights and Adam's moments: skip it, count it.
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        return norm if math.isfinite(norm) else 0.0
