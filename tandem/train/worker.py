"""The train worker: π_old when needed, advantages, and the policy update on one device.

One `train_step` is one RL step: π_old is recomputed for the batch unless the step is exactly
on-policy (then π_old is π_θ detached, from the same forward), the engine's logprobs are known to
equal it (`exact_behaviour`: then π_old is μ), or a correction replaces it;
advantages come from the rewards; each mini-batch is split into micro-batches by a token budget,
packed without padding, and its gradients accumulated, so the result does not depend on the split.
With data parallelism (`parallelize`) every rank gets the whole batch and works on its shard of
each mini-batch's rows. The off-policy corrections (`algo.corrections`) weight and mask the pg loss.
"""

import copy
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from tandem.algo import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    apply_corrections,
    interpolate_prox_logp,
    mismatch_metrics,
    old_logprob_source,
)
from tandem.algo.corrections import MASKING
from tandem.config import AlgoConfig, TrainConfig
from tandem.errors import TandemError
from tandem.model.decoder import CausalLM
from tandem.sample import Sample
from tandem.train import parallel
from tandem.train.batch import Rows, packed, pad_rows, padded, rank_micro_batches, score
from tandem.train.optim import make_optimizer, make_scheduler

# Where a step's π_old came from, logged as actor/old_logprob_source/<name> = 1.
OLD_SOURCES = ("recompute", "policy", "behaviour", "interpolate")


@dataclass
class MiniBatch:
    """The rows of one optimizer step: their samples and per-token tensors (b, R), on the CPU."""

    samples: list[Sample]
    rows: Tensor  # their indices in the step's batch
    mask: Tensor  # the loss mask
    adv: Tensor
    behaviour: Tensor  # μ, the engine's logprobs
    versions: Tensor  # the policy version that sampled each token
    old: Tensor | None  # π_old recomputed at step start; None when nothing was recomputed
    ref: Tensor | None


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
        keep_ref: bool = True,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        exact_behaviour: bool = False,
    ):
        """model: fp32 weights (they become the master weights); dtype: the compute dtype.
        keep_ref=False: a ref worker fills `Sample.ref_logprobs`, so no frozen copy is kept here.
        exact_behaviour: the engine's logprobs of tokens sampled by this trainer's current version
        equal its own bit for bit (run.deterministic, the same dtype, raw logprobs), so a step on
        such tokens takes μ as π_old, whatever its mini-batches and epochs, and never recomputes."""
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise TandemError("The trainer keeps fp32 master weights: load the policy in float32.")
        self.device, self.dtype = torch.device(device), dtype
        self.model = model.to(self.device).train()  # the fp32 master weights
        # What forward and backward run on: the masters themselves in fp32 and under fsdp2 (whose
        # policy casts), else a copy in the compute dtype whose gradients go to the masters.
        self.masters = None
        if dtype != torch.float32 and train.strategy != "fsdp2":
            self.masters = parallel.MasterWeights(self.model, dtype)
        self.compute = self.masters.compute if self.masters else self.model
        self.algo, self.cfg = algo, train
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        # The reference policy is the initial one, frozen, in the compute dtype (it is never updated,
        # so nothing rounds away); it is only kept when a KL term needs it.
        self.ref_model = None
        if algo.kl_coef > 0 and keep_ref:
            self.ref_model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
        if train.gradient_checkpointing:
            parallel.apply_ac(self.compute)
        self.module: torch.nn.Module = self.compute  # what the loss's forward runs through (DDP wraps it)
        self.sharded = False
        self.total_updates = total_updates
        self._make_optimizer()
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.skipped_steps = 0
        # seq-mean-token-sum-norm divides by a constant length (Dr. GRPO); the longest response
        # allowed, when known, so the scale does not drift with each batch's longest response.
        self.norm_len = norm_len
        # Where the PPO ratio's π_old comes from: the recompute, μ (bypass) or interpolated π_prox.
        self.old_source = old_logprob_source(algo.corrections, algo.prox_logprob)
        self.correction_options = dict(
            cap=algo.correction_cap, low=algo.mis_low, high=algo.mis_high, delta=algo.opsm_delta
        )
        self.exact_behaviour = exact_behaviour
        self.dp_group, self.rank, self.world = None, 0, 1

    def _make_optimizer(self) -> None:
        t = self.cfg
        self.optimizer = make_optimizer(self.model, t.lr, t.betas, t.weight_decay)
        self.scheduler = make_scheduler(
            self.optimizer, t.warmup_steps, self.total_updates, t.schedule, t.min_lr_ratio
        )

    def parallelize(self, group) -> None:
        """Join a data-parallel group under train.strategy (before the first step): ddp wraps the
        model in DistributedDataParallel, fsdp2 shards it (then the optimizer is built anew over
        the shards). The losses divide by counts of the whole mini-batch and are scaled by the
        world size, so the ranks' averaged gradient is exactly the single-worker gradient."""
        self.dp_group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.cfg.strategy == "fsdp2":
            parallel.apply_fsdp(self.model, group, self.dtype, self.cfg.offload)
            self.sharded = True
            self._make_optimizer()
        elif self.world > 1:
            self.module = parallel.apply_ddp(self.compute, group)

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.dp_group is not None and self.world > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters by Hugging Face name, for weight sync; under fsdp2 they are this rank's shards
        (DTensors): `parallel.full_tensor` gathers one."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def full_weights(self) -> dict[str, Tensor]:
        """Every parameter whole, on the CPU, gathered one at a time (collective under fsdp2)."""
        return parallel.gather(self.named_weights())

    def gather_weights(self, names: list[str]) -> None:
        """Take part in another rank's gathering of these tensors, in its order (fsdp2; else a no-op)."""
        if self.sharded:
            params = dict(self.named_weights())
            for name in names:
                parallel.full_tensor(params[name])

    def _rows(self, samples: list[Sample]) -> Rows:
        if self.cfg.padding_free:
            return packed(samples, self.device, self.temperature)
        return padded(samples, self.pad_token_id, self.device, self.temperature)

    def _plan(self, samples: list[Sample]) -> list[list[int]]:
        """This rank's micro-batches of `samples` (see `batch.rank_micro_batches`)."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        budget, pad = self.cfg.micro_batch_tokens, not self.cfg.padding_free
        return rank_micro_batches(lengths, budget, pad, self.rank, self.world)

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], model: torch.nn.Module | None = None) -> Tensor:
        """Logprobs of every response token under `model` (default: the policy) -> (B, R_max)."""
        model = model or self.compute
        width = max(max(len(s.response_ids) for s in samples), 1)
        out = torch.zeros(len(samples), width)
        for part in self._plan(samples):
            logp, _ = score(model, self._rows([samples[i] for i in part or [0]]), width)
            if part:
                out[part] = logp.cpu()
        return self._all_reduce(out)  # each row is non-zero on one rank only

    def advantages(self, samples: list[Sample], mask: Tensor) -> Tensor:
        """(B, R) advantages from the samples' rewards and groups, or (gae) the critic's per token;
        each sample's mean is stored on it."""
        if self.algo.adv_estimator == "gae":  # computed by the critic, where the values are
            missing = [s for s in samples if len(s.token_advantages) != len(s.response_ids)]
            if missing:
                raise TandemError(
                    f"algo.adv_estimator=gae but sample {missing[0].group_id}/{missing[0].index} has no "
                    "advantages from the critic (CriticWorker.estimate runs before the policy's step)."
                )
            adv = pad_rows([s.token_advantages for s in samples], mask.shape[1]) * mask
        else:
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
            groups = torch.tensor([s.group_id for s in samples])
            estimator = ADV_ESTIMATORS.get(self.algo.adv_estimator)
            adv = estimator(rewards, groups, mask, norm_by_std=self.algo.norm_by_std)
        for s, row, m in zip(samples, adv, mask, strict=True):
            s.advantage = float((row * m).sum() / m.sum().clamp(min=1))
        return adv

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL update on a batch of finished, rewarded samples -> metrics."""
        if self.cfg.strategy == "fsdp2" and not self.sharded:
            raise TandemError("train.strategy=fsdp2: call parallelize(group) before the first step.")
        self._check_samples(samples)
        width = max(max(len(s.response_ids) for s in samples), 1)
        mask = pad_rows([s.loss_mask for s in samples], width)
        behaviour = pad_rows([s.logprobs for s in samples], width)
        versions = pad_rows([s.versions for s in samples], width)
        source = self._step_source(samples)
        # bypass (π_old = μ), interpolated π_prox and an exactly on-policy step need no forward of their own.
        start = time.perf_counter()
        old = self.compute_logprobs(samples) if source == "recompute" else None
        logp_s = time.perf_counter() - start if old is not None else 0.0  # no recompute: no logp span
        ref = self._ref_logprobs(samples, width)
        adv = self.advantages(samples, mask)
        self._theta = torch.zeros(len(samples), width)  # π_θ detached, as the forwards compute it
        sums: dict[str, float] = defaultdict(float)
        updates, skipped = 0, self.skipped_steps
        for _ in range(self.cfg.epochs):
            for rows in self._mini_batches(len(samples)):
                batch = MiniBatch(
                    [samples[i] for i in rows],
                    rows,
                    mask[rows],
                    adv[rows],
                    behaviour[rows],
                    versions[rows],
                    old[rows] if old is not None else None,
                    ref[rows] if ref is not None else None,
                )
                for k, v in self._update(batch, source, first=updates == 0).items():
                    sums[k] += v
                if updates == 0:  # π_θ of the step-start weights on these rows: π_old
                    first_rows, first_theta = rows, self._theta[rows].clone()
                updates += 1
        self.version += 1
        metrics = {k: v / updates for k, v in sums.items()}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/skipped_steps"] = float(self.skipped_steps)
        metrics["actor/skipped_fraction"] = (self.skipped_steps - skipped) / updates  # of this step's updates
        metrics["timing_s/logp"] = logp_s
        metrics.update({f"actor/old_logprob_source/{n}": float(n == source) for n in OLD_SOURCES})
        valid = adv[mask > 0]  # over the tokens trained on, as verl reports them
        if valid.numel():
            metrics.update(
                {
                    "critic/advantages/mean": float(valid.mean()),
                    "critic/advantages/max": float(valid.max()),
                    "critic/advantages/min": float(valid.min()),
                }
            )
        # π_old held against μ: the recompute, or, where π_old is exactly on-policy (π_θ or an exact
        # μ), π_θ of the first update's forwards, on its rows. Without either (bypass, interpolate)
        # there is nothing to compare: no mismatch/*.
        if source == "policy" or (source == "behaviour" and self.old_source == "recompute"):
            old = self._all_reduce(first_theta)  # each row is non-zero on one rank only
            behaviour, mask = behaviour[first_rows], mask[first_rows]
        if old is not None:
            metrics.update(mismatch_metrics(old, behaviour, mask))
        return metrics

    def _step_source(self, samples: list[Sample]) -> str:
        """Where this step's π_old comes from: "policy" (π_θ detached) when the step is exactly
        on-policy with one update; "behaviour" (μ) when every token was sampled by this version and
        μ is exact (`exact_behaviour`); else the configured source (`self.old_source`)."""
        if self._on_policy(samples):
            return "policy"
        exact = self.exact_behaviour and self.old_source == "recompute" and self._sampled_now(samples)
        return "behaviour" if exact else self.old_source

    def _on_policy(self, samples: list[Sample]) -> bool:
        """True when π_old is exactly π_θ at the step's only update: every token was sampled by this
        version, one mini-batch, one epoch, and no correction masks by π_old before the forward."""
        return (
            self.old_source == "recompute"
            and self.cfg.epochs == 1
            and (self.cfg.mini_batch_size or len(samples)) >= len(samples)
            and not any(n in MASKING for n in self.algo.corrections)
            and self._sampled_now(samples)
        )

    def _sampled_now(self, samples: list[Sample]) -> bool:
        """Every response token was sampled by this trainer's current version."""
        return all(
            len(s.versions) == len(s.response_ids) and all(v == self.version for v in s.versions)
            for s in samples
        )

    def _ref_logprobs(self, samples: list[Sample], width: int) -> Tensor | None:
        """(B, R) reference logprobs: from the samples when a ref worker filled them, else computed
        on the frozen copy; None without a KL term."""
        if self.algo.kl_coef <= 0:
            return None
        if self.ref_model is None:
            missing = [s for s in samples if len(s.ref_logprobs) != len(s.response_ids)]
            if missing:
                raise TandemError(
                    f"algo.kl_coef={self.algo.kl_coef} and no local reference model, but sample "
                    f"{missing[0].group_id}/{missing[0].index} has no ref_logprobs from a ref worker."
                )
            return pad_rows([s.ref_logprobs for s in samples], width)
        return self.compute_logprobs(samples, self.ref_model)

    def _check_samples(self, samples: list[Sample]) -> None:
        """Corrections read μ of every response token, interpolation its version: a gap would read as 0."""
        for s in samples:
            n = len(s.response_ids)
            if self.algo.corrections and len(s.logprobs) != n:
                raise TandemError(
                    f"algo.corrections={self.algo.corrections} need the engine's logprob of every response "
                    f"token; sample {s.group_id}/{s.index} has {len(s.logprobs)} for {n} tokens."
                )
            if self.old_source == "interpolate" and len(s.versions) != n:
                raise TandemError(
                    "algo.prox_logprob=interpolate needs the policy version of every response token; "
                    f"sample {s.group_id}/{s.index} has {len(s.versions)} for {n} tokens."
                )

    def _mini_batches(self, n: int) -> list[Tensor]:
        size = self.cfg.mini_batch_size or n
        order = torch.randperm(n, generator=self.generator) if size < n else torch.arange(n)
        return [order[i : i + size] for i in range(0, n, size)]

    def _update(self, b: MiniBatch, source: str, first: bool) -> dict[str, float]:
        """Accumulate gradients over micro-batches, then one optimizer step (or a counted skip)."""
        # Every aggregation divides by counts of the whole mini-batch, so the micro-batch losses sum
        # to the mini-batch loss; the pg term counts only the tokens the corrections keep.
        pg_mask = self._pg_mask(b, first)
        counts = {"loss": self._counts(b.mask), "pg": self._counts(pg_mask)}
        sums = self._accumulate(b.samples, lambda part: self._micro_loss(b, pg_mask, part, counts, source))
        sums["actor/grad_norm"] = self._optimizer_step()
        return sums

    def _accumulate(
        self, samples: list[Sample], micro_loss: Callable[[list[int]], tuple[Tensor, dict[str, float]]]
    ) -> dict[str, float]:
        """Backward of `micro_loss(part)` for each of this rank's micro-batches of a mini-batch
        (`part`: indices into `samples`, [] for a dummy) -> the sums of their metric shares over
        every rank. The gradients are left for the optimizer step."""
        if len(samples) < self.world:
            raise TandemError(
                f"A mini-batch of {len(samples)} samples cannot be split over train.num_workers="
                f"{self.world} ranks; raise train.mini_batch_size or lower train.num_workers."
            )
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        plan = self._plan(samples)
        for k, part in enumerate(plan):
            # With master weights DDP reduces every micro-batch, whose gradients then join the
            # masters' fp32 sum; otherwise DDP and FSDP2 accumulate and reduce with the last.
            with parallel.gradient_sync(self.module, k == len(plan) - 1 or self.masters is not None):
                loss, stats = micro_loss(part)
                # DDP and FSDP2 average the ranks' gradients; the losses are shares of the whole
                # mini-batch's, whose gradient is the ranks' sum.
                (loss * self.world).backward()
            if self.masters is not None:
                self.masters.take_grads()
            for key, v in stats.items():
                sums[key] += v
        if self.world > 1:
            keys = sorted(sums)
            values = self._all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
            sums.update(zip(keys, values.tolist(), strict=True))
        return sums

    def _counts(self, mask: Tensor) -> dict[str, float]:
        return dict(
            global_tokens=float(mask.sum()),
            global_seqs=float((mask.sum(-1) > 0).sum()),
            norm_len=float(self.norm_len or mask.shape[1]),
        )

    def _micro_loss(
        self, b: MiniBatch, pg_mask: Tensor, idx: list[int], counts: dict[str, dict[str, float]], source: str
    ) -> tuple[Tensor, dict[str, float]]:
        """Forward one micro-batch -> its share of the mini-batch loss, and its share of the metrics.
        An empty `idx` is a dummy: a forward and backward of row 0 that add nothing."""
        a = self.algo
        width = b.mask.shape[1]
        rows = self._rows([b.samples[i] for i in idx or [0]])
        logp, entropy = score(self.module, rows, width)
        if not idx:
            return logp.sum() * 0.0, {}

        def part(t: Tensor) -> Tensor:
            return t[idx].to(self.device)

        m, pm, adv, behaviour = part(b.mask), part(pg_mask), part(b.adv), part(b.behaviour)
        self._theta[b.rows[idx]] = logp.detach().cpu()
        # Entropy is always logged; it joins the graph only when it is part of the loss.
        entropy = entropy if a.entropy_coef else entropy.detach()
        old = self._old_logprobs(
            source, part(b.old) if b.old is not None else None, behaviour, part(b.versions), logp
        )
        # The weights are per row; the mask is pg_mask, fixed for the mini-batch before its first micro-batch.
        weight, _, corrected = apply_corrections(
            a.corrections, logp, old, behaviour, adv, m, **self.correction_options
        )
        pg, stats = POLICY_LOSSES.get(a.policy_loss)(
            logp, old, adv, pm, clip_low=a.clip_low, clip_high=a.clip_high, clip_c=a.clip_c
        )
        pg_loss = aggregate(a.loss_agg, pg * weight, pm, **counts["pg"])
        loss = pg_loss - a.entropy_coef * aggregate(a.loss_agg, entropy, m, **counts["loss"])
        # Per-token metrics are means over the mini-batch's tokens (the pg ones over the pg mask's).
        tokens, pg_tokens = max(counts["loss"]["global_tokens"], 1.0), max(counts["pg"]["global_tokens"], 1.0)
        out = {
            "actor/pg_loss": float(pg_loss.detach()),
            "actor/entropy": float((entropy.detach() * m).sum()) / tokens,
        }
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            if key in stats:
                out[f"actor/{key}"] = float((stats[key].detach() * pm).sum()) / pg_tokens
        for key, share in corrected.items():  # shares of this micro-batch's tokens
            out[key] = share * float(m.sum()) / tokens
        if rows.agreement is not None:  # routing replay: how often the trainer's own router agreed
            out["mismatch/routing_agreement"] = rows.agreement * float(m.sum()) / tokens
        if b.ref is not None:
            kl = aggregate(
                a.loss_agg, KL_ESTIMATORS.get(a.kl_estimator)(logp, part(b.ref)), m, **counts["loss"]
            )
            loss = loss + a.kl_coef * kl
            out["actor/kl_loss"] = float(kl.detach())
        return loss, out

    def _old_logprobs(
        self, source: str, old: Tensor | None, behaviour: Tensor, versions: Tensor, logp: Tensor | None
    ) -> Tensor:
        """The PPO ratio's π_old (b, R): the recompute, π_θ detached (exactly on-policy), μ (bypass),
        or decoupled's π_prox interpolated between μ and π_θ (logp)."""
        if source == "behaviour":
            return behaviour
        if source in ("interpolate", "policy"):
            assert logp is not None, f"{source} needs π_θ"
            if source == "policy":
                return logp.detach()
            # π_prox is the step-start policy (version self.version); π_θ becomes self.version + 1.
            return interpolate_prox_logp(behaviour, logp, versions, self.version, self.version + 1)
        assert old is not None, "π_old is recomputed at step start unless on-policy, bypass or interpolate"
        return old

    def _pg_mask(self, b: MiniBatch, first: bool) -> Tensor:
        """The mini-batch's loss mask less what the corrections drop -> (b, R).

        Fixed before the first micro-batch, because the pg loss divides by its counts. When it
        depends on π_θ (opsm, or any masking entry with interpolated π_prox) that costs a no-grad
        forward over the mini-batch, except on the step's first update after a recompute, where π_θ
        is π_old.
        """
        names = self.algo.corrections
        if not any(n in MASKING for n in names):
            return b.mask  # only weights: every token stays in the pg loss
        theta = None
        if "opsm" in names or self.old_source == "interpolate":
            theta = b.old if first and b.old is not None else self._policy_logprobs(b)
        old = self._old_logprobs(self.old_source, b.old, b.behaviour, b.versions, theta)
        # Without theta no entry here reads π_θ (only opsm and interpolation do), so old stands in.
        logp = theta if theta is not None else old
        _, mask, _ = apply_corrections(
            names, logp, old, b.behaviour, b.adv, b.mask, **self.correction_options
        )
        return mask

    def _policy_logprobs(self, b: MiniBatch) -> Tensor:
        """π_θ of the mini-batch's tokens, no grad, at the width of its other tensors -> (b, R)."""
        out = torch.zeros_like(b.mask)
        logp = self.compute_logprobs(b.samples)
        out[:, : logp.shape[1]] = logp
        return out

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = float(parallel.full_tensor(torch.nn.utils.clip_grad_norm_(params, clip)))
        if not math.isfinite(norm):
            # A NaN/inf gradient would poison the weights and Adam's moments: skip it, count it.
            # The norm is global, so every rank skips together.
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
            if self.masters is not None:
                self.masters.refresh()
        return norm if math.isfinite(norm) else 0.0
