"""The train worker: π_old when needed, advantages, and the policy update on one device.

One `train_step` is one RL step: π_old is recomputed for the batch unless the step is exactly
on-policy (then π_old is π_θ detached, from the same forward), the engine's logprobs are known to
equal it (`exact_behaviour`: then π_old is μ), or a correction replaces it;
advantages come from the rewards (`tandem.train.advantages`); each mini-batch is split into
micro-batches by a token budget, packed without padding, and its gradients accumulated, so the
result does not depend on the split.
With data parallelism (`parallelize`) every rank gets the whole batch and works on its shard of
each mini-batch's rows. The off-policy corrections (`algo.corrections`) weight and mask the pg loss.
The worker is the policy's loss; its `Learner` keeps the weights and steps them.
"""

import copy
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tandem import heap
from tandem.algo import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    apply_corrections,
    interpolate_prox_logp,
    mismatch_metrics,
    old_logprob_source,
)
from tandem.algo.corrections import CORRECTIONS, OldSource
from tandem.config import AlgoConfig, TrainConfig
from tandem.errors import TandemError
from tandem.model.decoder import CausalLM
from tandem.model.lora import adapter_names, adapters_off, has_lora
from tandem.sample import Sample
from tandem.train.advantages import advantage_metrics, advantages
from tandem.train.batch import pad_rows, score
from tandem.train.learner import Learner, loss_counts


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

    def take(self, rows: Tensor) -> "MiniBatch":
        """The mini-batch of these rows of this one (indices into its rows)."""
        return MiniBatch(
            [self.samples[i] for i in rows],
            self.rows[rows],
            self.mask[rows],
            self.adv[rows],
            self.behaviour[rows],
            self.versions[rows],
            self.old[rows] if self.old is not None else None,
            self.ref[rows] if self.ref is not None else None,
        )


class TrainWorker:
    """The policy's loss on a `Learner` (precision, parallelism, accumulation, optimizer, state)."""

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
        A model with LoRA adapters (`tandem.model.lora`) trains them only, and its reference is
        itself with the adapters off: never a copy, nor a ref worker.
        exact_behaviour: the engine's logprobs of tokens sampled by this trainer's current version
        equal its own bit for bit (run.deterministic, the same dtype, raw logprobs), so a step on
        such tokens takes μ as π_old, whatever its mini-batches and epochs, and never recomputes."""
        # The reference policy is the initial one, frozen, in the compute dtype (it is never updated,
        # so nothing rounds away); it is only kept when a KL term needs it. Copied before the learner
        # applies activation checkpointing to the model's layers.
        self.ref_model = None
        self.lora = has_lora(model)
        if algo.kl_coef > 0 and keep_ref and not self.lora:
            self.ref_model = copy.deepcopy(model).to(torch.device(device)).to(dtype)
            self.ref_model.eval().requires_grad_(False)
        self.learner = Learner(model, train, pad_token_id, total_updates, seed, device, dtype)
        self.algo, self.cfg = algo, train
        self.temperature = temperature if temperature > 0 else 1.0
        self.version = 0
        # seq-mean-token-sum-norm divides by a constant length (Dr. GRPO); the longest response
        # allowed, when known, so the scale does not drift with each batch's longest response.
        self.norm_len = norm_len
        # Where the PPO ratio's π_old comes from: the recompute, μ (bypass) or interpolated π_prox.
        self.old_source = old_logprob_source(algo.corrections, algo.prox_logprob)
        self.correction_options = dict(
            cap=algo.correction_cap, low=algo.mis_low, high=algo.mis_high, delta=algo.opsm_delta
        )
        self.exact_behaviour = exact_behaviour

    @property
    def model(self) -> CausalLM:
        """The fp32 master weights (under fsdp2, this rank's shards)."""
        return self.learner.model

    @property
    def compute(self) -> nn.Module:
        """What forward and backward run on: the masters, or their copy in the compute dtype."""
        return self.learner.compute

    @property
    def rank(self) -> int:
        return self.learner.rank

    def parallelize(self, group) -> None:
        """Join a data-parallel group under train.strategy, before the first step (`Learner.parallelize`)."""
        self.learner.parallelize(group)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters by Hugging Face name, for weight sync (`Learner.named_weights`)."""
        return self.learner.named_weights()

    def pushed_weights(self) -> Iterator[tuple[str, Tensor]]:
        """What a weight push carries, by name, in `named_weights` order: every parameter, or with
        LoRA only what trains (`adapter_names`: the adapters, modules_to_save), as a LoRA run's
        engines plan it from the model's config (`adapter_shapes`). Shards under fsdp2."""
        if not self.lora:
            return self.named_weights()
        names = set(adapter_names(self.model))
        return ((n, t) for n, t in self.named_weights() if n in names)

    def full_weights(self) -> dict[str, Tensor]:
        """Every parameter whole, on the CPU (collective under fsdp2)."""
        return self.learner.full_weights()

    def gather_weights(self, names: list[str]) -> None:
        """Take part in another rank's gathering of these tensors, in its order (fsdp2; else a no-op)."""
        self.learner.gather_weights(names)

    def compute_logprobs(self, samples: list[Sample], model: nn.Module | None = None) -> Tensor:
        """Logprobs of every response token under `model` (default: the policy) -> (B, R_max)."""
        model = model or self.learner.compute

        def logprobs(chunk: list[Sample], width: int) -> Tensor:
            return score(model, self.learner.rows(chunk, self.temperature), width)[0]

        return self.learner.per_token(samples, logprobs)

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL update on a batch of finished, rewarded samples -> metrics."""
        if self.cfg.strategy == "fsdp2" and not self.learner.sharded:
            raise TandemError("train.strategy=fsdp2: call parallelize(group) before the first step.")
        self._check_samples(samples)
        source = self._step_source(samples)
        # bypass (π_old = μ), interpolated π_prox and an exactly on-policy step need no forward of their own.
        start = time.perf_counter()
        old = self.compute_logprobs(samples) if source is OldSource.RECOMPUTE else None
        logp_s = time.perf_counter() - start if old is not None else 0.0  # no recompute: no logp span
        batch = self._batch(samples, old)
        skipped = self.learner.skipped_steps
        sums, updates, first = self._updates(batch, source)
        self.version += 1
        metrics = {k: v / updates for k, v in sums.items()}
        metrics["actor/lr"] = self.learner.scheduler.get_last_lr()[0]
        metrics["actor/skipped_steps"] = float(self.learner.skipped_steps)
        # the share of this step's updates that were skipped
        metrics["actor/skipped_fraction"] = (self.learner.skipped_steps - skipped) / updates
        metrics["timing_s/logp"] = logp_s
        metrics.update({f"actor/old_logprob_source/{n.value}": float(n is source) for n in OldSource})
        metrics.update(advantage_metrics(batch.adv, batch.mask))
        metrics.update(self._mismatch(batch, source, *first))
        heap.trim()  # the step's activations and gradients, freed into the heap's holes
        return metrics

    def step_accumulated(self, hyper: dict[str, Any]) -> float:
        """One optimizer step on the gradients accumulated since the last (a client's own loop: the
        Tinker API's forward_backward calls, then optim_step) with AdamW's hyper-parameters `hyper`
        (`Learner.set_hyperparameters`' arguments) -> the gradient norm; the gradients are cleared
        and the policy version advances, as a train step's do."""
        self.learner.set_hyperparameters(**hyper)
        norm = self.learner.step()
        self.learner.clear_gradients()
        self.version += 1
        return norm

    def _batch(self, samples: list[Sample], old: Tensor | None) -> MiniBatch:
        """The step's whole batch: its per-token tensors (B, R), with π_old recomputed (or None),
        the reference logprobs and the advantages."""
        width = max(max(len(s.response_ids) for s in samples), 1)
        mask = pad_rows([s.loss_mask for s in samples], width)
        behaviour = pad_rows([s.logprobs for s in samples], width)
        versions = pad_rows([s.versions for s in samples], width)
        ref = self._ref_logprobs(samples, width)
        adv = advantages(samples, mask, self.algo)
        return MiniBatch(samples, torch.arange(len(samples)), mask, adv, behaviour, versions, old, ref)

    def _updates(
        self, batch: MiniBatch, source: OldSource
    ) -> tuple[dict[str, float], int, tuple[MiniBatch, Tensor]]:
        """Every epoch's optimizer steps over the batch's mini-batches -> the sums of their metrics,
        their count, and the first one's mini-batch with π_θ (b, R) as its forwards computed it:
        the step-start weights', π_old."""
        sums: dict[str, float] = defaultdict(float)
        updates, first = 0, None
        for _ in range(self.cfg.epochs):
            for rows in self.learner.mini_batches(len(batch.samples)):
                mini = batch.take(rows)
                step, theta = self._update(mini, source, first=updates == 0)
                for k, v in step.items():
                    sums[k] += v
                if first is None:
                    first = (mini, theta)
                updates += 1
        return sums, updates, first

    def _mismatch(
        self, batch: MiniBatch, source: OldSource, first: MiniBatch, theta: Tensor
    ) -> dict[str, float]:
        """π_old held against μ: the recompute, or, where π_old is exactly on-policy (π_θ or an exact
        μ), π_θ of the first update's forwards (`theta`), on its rows (`first`). Without either
        (bypass, interpolate) there is nothing to compare: no mismatch/*."""
        old, behaviour, mask = batch.old, batch.behaviour, batch.mask
        exact = source is OldSource.BEHAVIOUR and self.old_source is OldSource.RECOMPUTE
        if source is OldSource.POLICY or exact:
            old = self.learner.all_reduce(theta)  # each row is non-zero on one rank only
            behaviour, mask = first.behaviour, first.mask
        return mismatch_metrics(old, behaviour, mask) if old is not None else {}

    def _step_source(self, samples: list[Sample]) -> OldSource:
        """Where this step's π_old comes from: POLICY (π_θ detached) when the step is exactly
        on-policy with one update; BEHAVIOUR (μ) when every token was sampled by this version and
        μ is exact (`exact_behaviour`); else the configured source (`self.old_source`)."""
        if self._on_policy(samples):
            return OldSource.POLICY
        recompute = self.old_source is OldSource.RECOMPUTE
        exact = self.exact_behaviour and recompute and self._sampled_now(samples)
        return OldSource.BEHAVIOUR if exact else self.old_source

    def _on_policy(self, samples: list[Sample]) -> bool:
        """True when π_old is exactly π_θ at the step's only update: every token was sampled by this
        version, one mini-batch, one epoch, and no correction masks by π_old before the forward."""
        return (
            self.old_source is OldSource.RECOMPUTE
            and self.cfg.epochs == 1
            and (self.cfg.mini_batch_size or len(samples)) >= len(samples)
            and not any(CORRECTIONS.traits(n).masks for n in self.algo.corrections)
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
        on the frozen copy, or with LoRA on the policy with its adapters off; None without a KL term."""
        if self.algo.kl_coef <= 0:
            return None
        if self.lora:  # the base policy: the same weights, adapters off (verl's and TRL's way)
            with adapters_off(self.learner.compute):
                return self.compute_logprobs(samples)
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
            if self.old_source is OldSource.INTERPOLATE and len(s.versions) != n:
                raise TandemError(
                    "algo.prox_logprob=interpolate needs the policy version of every response token; "
                    f"sample {s.group_id}/{s.index} has {len(s.versions)} for {n} tokens."
                )

    def _update(self, b: MiniBatch, source: OldSource, first: bool) -> tuple[dict[str, float], Tensor]:
        """Accumulate gradients over micro-batches, then one optimizer step (or a counted skip) ->
        the sums of the metric shares, and π_θ (b, R) detached as the forwards computed it (0 on
        the rows of the other ranks). Rows with no signal (`_silent`) run their forwards alone, for
        the metrics; a mini-batch of nothing else takes no optimizer step."""
        # Every aggregation divides by counts of the whole mini-batch, so the micro-batch losses sum
        # to the mini-batch loss; the pg term counts only the tokens the corrections keep.
        pg_mask = self._pg_mask(b, first)
        counts = {"loss": loss_counts(b.mask, self.norm_len), "pg": loss_counts(pg_mask, self.norm_len)}
        silent = self._silent(b)
        loud = [i for i in range(len(b.samples)) if i not in silent]
        if (loud and len(loud) < self.learner.world) or (silent and len(silent) < self.learner.world):
            silent, loud = set(), list(range(len(b.samples)))  # too few to share out over the ranks
        outputs, sums = [], defaultdict(float)
        # The forwards alone first: accumulate() clears the gradients the backward ones leave.
        for rows, backward in ((sorted(silent), False), (loud, True)):
            if not rows:
                continue
            part_sums, part_outputs = self.learner.accumulate(
                [b.samples[i] for i in rows],
                lambda part, rows=rows: self._micro_loss(b, pg_mask, [rows[i] for i in part], counts, source),
                backward=backward,
            )
            for key, v in part_sums.items():
                sums[key] += v
            outputs += [([rows[i] for i in part], logp) for part, logp in part_outputs]
        sums["actor/grad_norm"] = self.learner.step() if loud else 0.0
        sums["actor/no_signal_fraction"] = len(silent) / len(b.samples)
        theta = torch.zeros(b.mask.shape)
        for rows, logp in outputs:
            theta[rows] = logp
        return sums, theta

    def _silent(self, b: MiniBatch) -> set[int]:
        """The rows whose share of the loss is exactly 0 whatever the weights: every advantage of
        theirs is 0 (their group's responses scored alike: every policy loss is a multiple of A) and
        no KL or entropy term joins the loss. Their backward would add exact zeros to the gradient,
        so it is skipped, and the mini-batch's gradient is that of its other rows (the loss still
        divides by the whole mini-batch's token counts). When no row is left, the optimizer step is
        skipped too (as a non-finite one is): AdamW would move the weights by its momentum alone.
        The forwards still run: the step's metrics (mismatch, entropy, corrections) cover every row.
        Every rank holds the whole mini-batch's advantages, so all of them decide alike."""
        if self.algo.kl_coef > 0 or self.algo.entropy_coef != 0:
            return set()
        return {i for i, row in enumerate(b.adv * b.mask) if not bool(row.any())}

    def _micro_loss(
        self,
        b: MiniBatch,
        pg_mask: Tensor,
        idx: list[int],
        counts: dict[str, dict[str, float]],
        source: OldSource,
    ) -> tuple[Tensor, dict[str, float], Tensor | None]:
        """Forward one micro-batch -> its share of the mini-batch loss, its share of the metrics, and
        its π_θ detached (len(idx), R) on the CPU. An empty `idx` is a dummy: a forward and backward
        of row 0 that add nothing (and no π_θ)."""
        a = self.algo
        width = b.mask.shape[1]
        rows = self.learner.rows([b.samples[i] for i in idx or [0]], self.temperature)
        logp, entropy = score(self.learner.module, rows, width)
        if not idx:
            return logp.sum() * 0.0, {}, None

        def part(t: Tensor) -> Tensor:
            return t[idx].to(self.learner.device)

        m, pm, adv, behaviour = part(b.mask), part(pg_mask), part(b.adv), part(b.behaviour)
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
        return loss, out, logp.detach().cpu()

    def _old_logprobs(
        self, source: OldSource, old: Tensor | None, behaviour: Tensor, versions: Tensor, logp: Tensor | None
    ) -> Tensor:
        """The PPO ratio's π_old (b, R): the recompute, π_θ detached (exactly on-policy), μ (bypass),
        or decoupled's π_prox interpolated between μ and π_θ (logp)."""
        if source is OldSource.BEHAVIOUR:
            return behaviour
        if source in (OldSource.INTERPOLATE, OldSource.POLICY):
            assert logp is not None, f"{source.value} needs π_θ"
            if source is OldSource.POLICY:
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
        if not any(CORRECTIONS.traits(n).masks for n in names):
            return b.mask  # only weights: every token stays in the pg loss
        theta = None
        if any(CORRECTIONS.traits(n).reads_theta for n in names) or self.old_source is OldSource.INTERPOLATE:
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
