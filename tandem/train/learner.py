"""The learner: what steps a model's weights, whatever its loss (the policy's or the critic's).

It keeps the fp32 master weights and runs forward and backward in the compute dtype, applies the
parallelism (`parallel`: activation checkpointing, then DDP or FSDP2), splits a batch into
mini-batches (one optimizer step each) and each mini-batch into this rank's micro-batches by a
token budget, accumulates their gradients, steps AdamW and its LR schedule with a guard against
non-finite gradients, and saves and loads all of that. The loss is the caller's: `accumulate` takes
a function of one micro-batch.
"""

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tandem.config import TrainConfig
from tandem.errors import TandemError
from tandem.model.decoder import CausalLM
from tandem.sample import Sample
from tandem.train import parallel
from tandem.train.batch import Rows, packed, padded, rank_micro_batches
from tandem.train.optim import make_optimizer, make_scheduler
from tandem.train.state import dcp, rng_states, set_rng_states

# One micro-batch's loss: `part` (indices into the mini-batch's samples; [] for a dummy forward) ->
# (its share of the mini-batch's loss, its shares of the metrics, a detached per-token output
# (len(part), R) to hand back, or None).
MicroLoss = Callable[[list[int]], tuple[Tensor, dict[str, float], Tensor | None]]


def loss_counts(mask: Tensor, norm_len: int | None = None) -> dict[str, float]:
    """mask (b, R) -> the counts of a whole mini-batch that every micro-batch's `aggregate` divides
    by, so the micro-batch losses sum to the mini-batch loss. norm_len: the constant length of
    seq-mean-token-sum-norm (default: the mask's width)."""
    return dict(
        global_tokens=float(mask.sum()),
        global_seqs=float((mask.sum(-1) > 0).sum()),
        norm_len=float(norm_len or mask.shape[1]),
    )


class Learner:
    def __init__(
        self,
        model: CausalLM,
        train: TrainConfig,
        pad_token_id: int,
        total_updates: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        """model: fp32 weights (they become the master weights); dtype: the compute dtype;
        total_updates: the optimizer steps of the run (the LR schedule's length); seed: the
        mini-batch shuffle's. Parameters that do not require grad (a LoRA run's base,
        `tandem.model.lora`) are frozen: outside the optimizer and the checkpoints, and under ddp or
        one worker kept in the compute dtype only (`parallel.MasterWeights`)."""
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise TandemError("The trainer keeps fp32 master weights: load the policy in float32.")
        self.device, self.dtype, self.cfg = torch.device(device), dtype, train
        self.pad_token_id = pad_token_id
        self.model = model.to(self.device).train()  # the fp32 master weights
        # What forward and backward run on: the masters themselves in fp32 and under fsdp2 (whose
        # policy casts), else a copy in the compute dtype whose gradients go to the masters.
        self.masters = None
        if dtype != torch.float32 and train.strategy != "fsdp2":
            self.masters = parallel.MasterWeights(self.model, dtype)
        self.compute = self.masters.compute if self.masters else self.model
        if train.gradient_checkpointing:
            parallel.apply_ac(self.compute)
        self.module: torch.nn.Module = self.compute  # what the loss's forward runs through (DDP wraps it)
        self.sharded = False
        self.total_updates = total_updates
        self._make_optimizer()
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
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

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum of `t` over the data-parallel ranks, in place (itself alone)."""
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

    def rows(self, samples: list[Sample], temperature: float = 1.0) -> Rows:
        """A micro-batch as the model takes it: packed (train.padding_free), each prompt once where
        neighbours share it (`sharing`), or padded, on the device."""
        if self.cfg.padding_free:
            return packed(samples, self.device, temperature, share=self.sharing)
        return padded(samples, self.pad_token_id, self.device, temperature)

    @property
    def sharing(self) -> bool:
        """train.share_prompts, in packed rows (in the batch-invariant mode too: its attention lays
        each response's keys out as in a sequence of its own, `tandem.model.segments.tree_attention`)."""
        return self.cfg.share_prompts and self.cfg.padding_free

    def plan(self, samples: list[Sample]) -> list[list[int]]:
        """This rank's micro-batches of `samples` (see `batch.rank_micro_batches`). When prompts are
        shared, the samples of one prompt go together, next to each other, and count its tokens once."""
        budget, pad = self.cfg.micro_batch_tokens, not self.cfg.padding_free
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(samples if self.sharing else []):
            groups.setdefault(tuple(s.prompt_ids), []).append(i)
        units = list(groups.values())
        # Fewer prompts than ranks: some rank would hold none and no metric, and the ranks' sums
        # would not line up; share them out by rows instead.
        if not self.sharing or len(units) < self.world:
            lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
            return rank_micro_batches(lengths, budget, pad, self.rank, self.world)
        lengths = [
            len(samples[u[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in u) for u in units
        ]
        parts = rank_micro_batches(lengths, budget, pad, self.rank, self.world)
        return [[i for u in part for i in units[u]] for part in parts]

    @torch.no_grad()
    def per_token(self, samples: list[Sample], forward: Callable[[list[Sample], int], Tensor]) -> Tensor:
        """`forward(chunk, width)` -> (len(chunk), width) over this rank's micro-batches, no grad ->
        (B, R_max) on the CPU, every rank's rows."""
        width = max(max(len(s.response_ids) for s in samples), 1)
        out = torch.zeros(len(samples), width)
        self.compute.eval()  # the policy itself: no LoRA dropout in a score
        try:
            for part in self.plan(samples):
                t = forward([samples[i] for i in part or [0]], width)
                if part:
                    out[part] = t.cpu()
        finally:
            self.compute.train()
        return self.all_reduce(out)  # each row is non-zero on one rank only

    def mini_batches(self, n: int) -> list[Tensor]:
        """The row indices of each optimizer step over a batch of n: train.mini_batch_size rows,
        shuffled by the learner's generator, or the whole batch in order."""
        size = self.cfg.mini_batch_size or n
        order = torch.randperm(n, generator=self.generator) if size < n else torch.arange(n)
        return [order[i : i + size] for i in range(0, n, size)]

    def accumulate(
        self, samples: list[Sample], micro_loss: MicroLoss, backward: bool = True, fresh: bool = True
    ) -> tuple[dict[str, float], list[tuple[list[int], Tensor]]]:
        """Backward of `micro_loss(part)` for each of this rank's micro-batches of a mini-batch ->
        the sums of their metric shares over every rank, and this rank's (part, output) for each
        output `micro_loss` returned. The gradients are left for `step`. backward=False: the
        forwards alone, without autograd (a mini-batch whose loss is 0 whatever the weights).
        fresh=False: add to the gradients already there instead of clearing them first (`tandem
        serve`: Tinker adds every forward_backward's until optim_step)."""
        if len(samples) < self.world:
            raise TandemError(
                f"A mini-batch of {len(samples)} samples cannot be split over train.num_workers="
                f"{self.world} ranks; raise train.mini_batch_size or lower train.num_workers."
            )
        if fresh:
            self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        outputs = []
        plan = self.plan(samples)
        for k, part in enumerate(plan):
            # With master weights DDP reduces every micro-batch, whose gradients then join the
            # masters' fp32 sum; otherwise DDP and FSDP2 accumulate and reduce with the last.
            if not backward:
                with torch.no_grad():
                    _, stats, output = micro_loss(part)
            else:
                with parallel.gradient_sync(self.module, k == len(plan) - 1 or self.masters is not None):
                    loss, stats, output = micro_loss(part)
                    # DDP and FSDP2 average the ranks' gradients; the losses are shares of the whole
                    # mini-batch's, whose gradient is the ranks' sum.
                    (loss * self.world).backward()
                if self.masters is not None:
                    self.masters.take_grads()
            for key, v in stats.items():
                sums[key] += v
            if output is not None:
                outputs.append((part, output))
        if self.world > 1:
            keys = sorted(sums)
            values = self.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
            sums.update(zip(keys, values.tolist(), strict=True))
        return sums, outputs

    def step(self) -> float:
        """One optimizer step on the accumulated gradients, clipped to train.grad_clip -> their
        norm; a non-finite norm skips the step (counted in `skipped_steps`) and returns 0."""
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

    def set_hyperparameters(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_clip: float
    ) -> None:
        """AdamW's hyper-parameters and the clip norm for the steps that follow, in place of the
        config's and the schedule's (`tandem serve`: the client gives them at each optim_step).
        grad_clip 0: no clipping."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.cfg = replace(self.cfg, grad_clip=grad_clip)

    def clear_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def take_trainable(self) -> dict[str, tuple[Tensor, Tensor | None, dict]]:
        """What trains, taken out: each trainable parameter's name -> (its value, its accumulated
        gradient or None, its AdamW state), the gradient and state handed over (the learner keeps
        none of them). With `put_trainable`, one learner trains several adapters on one base in
        turn (`tandem serve`'s clients), each with its own gradients and moments."""
        if self.sharded:
            raise TandemError("Only an unsharded learner's adapters are taken out (fsdp2 shards them).")
        taken = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                taken[name] = (p.detach().clone(), p.grad, self.optimizer.state.pop(p, {}))
                p.grad = None
        return taken

    @torch.no_grad()
    def put_trainable(self, taken: dict[str, tuple[Tensor, Tensor | None, dict]]) -> None:
        """Every trainable parameter set from `taken` (`take_trainable`'s form; a fresh adapter's
        values come with no gradient and an empty state); the compute copy follows."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(taken) != set(params):
            raise TandemError(f"put_trainable: {len(taken)} tensors for {len(params)} trainable parameters.")
        for name, p in params.items():
            value, p.grad, state = taken[name]
            p.copy_(value)
            self.optimizer.state.pop(p, None)
            if state:
                self.optimizer.state[p] = state
        if self.masters is not None:
            self.masters.refresh()

    def forget_optimizer_state(self) -> None:
        """AdamW's moments and step counts dropped: the next step starts them afresh (the weights
        stay). `tandem serve`'s load of a checkpoint without its optimizer."""
        self.optimizer.state.clear()

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state dicts as checkpoints hold them: what trains. Frozen
        parameters (a LoRA run's base) come from model.path again, so they are left out (a tied
        one under both its names, which `ignore_frozen_params` would keep under one)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # ~1 s to import: see dcp()

        model_sd, optim_sd = get_state_dict(self.model, [self.optimizer])
        frozen = {n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd

    def save(self, root: Path, extra: dict[str, Any]) -> None:
        """Every rank, collectively: `root/` (DCP: the trained master weights and optimizer state, each
        rank its shards) and `root/rank_<r>.pt` (the rest of this rank's state, and `extra`)."""
        model_sd, optim_sd = self.state()
        group = self.dp_group
        with _one_process_is_fine():
            dcp().save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=root,
                process_group=group,
                no_dist=group is None,
            )
        own = {
            **extra,
            "skipped_steps": self.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "rng": rng_states(),
        }
        torch.save(own, root / f"rank_{self.rank}.pt")

    def load(self, root: Path) -> dict[str, Any]:
        """Every rank, collectively, after `parallelize`: the state `save` wrote into `root` -> the
        rank's saved dict (`extra` among it)."""
        model_sd, optim_sd = self.state()
        state = {"model": model_sd, "optim": optim_sd}
        group = self.dp_group
        with _one_process_is_fine():
            dcp().load(state, checkpoint_id=root, process_group=group, no_dist=group is None)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(  # strict=False: the frozen parameters are left out (`state`)
            self.model,
            [self.optimizer],
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=False),
        )
        if self.masters is not None:  # the compute copy takes the loaded masters, rounded once
            self.masters.refresh()
        own_file = root / f"rank_{self.rank}.pt"
        if not own_file.exists():  # a checkpoint of fewer ranks: rank 0's schedule is every rank's
            own_file = root / "rank_0.pt"
        own = torch.load(own_file, weights_only=False)  # our own file: NumPy's RNG state is not a tensor
        self.skipped_steps = own["skipped_steps"]
        self.scheduler.load_state_dict(own["scheduler"])
        self.generator.set_state(own["generator"])
        set_rng_states(own["rng"])
        return own


@contextmanager
def _one_process_is_fine():
    """DCP warns that it assumes one process when no process group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
