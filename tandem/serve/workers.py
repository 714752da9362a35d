"""The service's two workers: tandem's train and rollout actors, with the calls the Tinker API
makes of them, reached through the cluster interface `tandem train` uses
(`tandem.controller.protocol.Cluster`).

`ServeTrainer` is a `TrainActor` (a `TrainWorker` and its `Learner`): a forward_backward is the
learner's micro-batched forward and backward under one of `tandem.serve.losses`, with the
gradients accumulated until optim_step, which steps AdamW with the client's parameters; weights
reach the engine by the actor's own versioned push (`send_weights` / `receive_weights`), and state
saves and loads are the actor's checkpoints (`save` / `load`: weights, optimizer, schedule, RNGs).
`ServeRollout` is a `RolloutActor`: sampling is its worker's generate call.

In one process (run.cluster auto or local), each worker gets a `LocalCluster` of its own (one
call thread each, calls in order), so a sample runs while a forward_backward runs, on threads of
one process. With run.cluster=ray both are Ray actors of one `RayCluster`, placed as `tandem
train`'s are (placement.*, ray.address to join a cluster of several machines): the roles table's
trainer and engine rows, built as these subclasses.
"""

import dataclasses
from typing import TYPE_CHECKING

import torch

from tandem import devices
from tandem.config import Config
from tandem.errors import TandemError
from tandem.runtime.actors import RolloutActor, TrainActor, _plan
from tandem.runtime.checks import one_process_refusal
from tandem.runtime.local import LocalCluster, cpu_threads
from tandem.runtime.roles import build_rollout, build_trainer, load_checked_tokenizer
from tandem.runtime.run import with_absolute_paths
from tandem.sample import Prompt, Sample, SamplingParams
from tandem.serve.losses import LOSSES
from tandem.serve.wire import Datum, Sequence
from tandem.sync import StagingBuffer
from tandem.train.batch import pad_rows, score, sequence_logprobs

if TYPE_CHECKING:  # imported where a run on Ray starts: one process never loads Ray
    from tandem.runtime.cluster import RayCluster


def with_lora(cfg: Config, rank: int, seed: int, attn: bool, mlp: bool) -> Config:
    """The service's config for a model of LoRA rank `rank` (0: every weight trains) on the
    attention and/or MLP projections. The service's rows are whole sequences each, so the learner
    never packs neighbours as one shared prompt (train.share_prompts)."""
    targets = [
        *(["q_proj", "k_proj", "v_proj", "o_proj"] if attn else []),
        *(["gate_proj", "up_proj", "down_proj"] if mlp else []),
    ]
    lora = dataclasses.replace(cfg.train.lora, rank=rank, target_modules=targets)
    train = dataclasses.replace(cfg.train, lora=lora, share_prompts=False)
    return dataclasses.replace(cfg, train=train, run=dataclasses.replace(cfg.run, seed=seed))


def as_samples(data: list[Datum]) -> list[Sample]:
    """Tinker datums as tandem samples: the first input token is the prompt, the targets the
    response (the input shifted by one), so the trainer scores every target position."""
    return [
        Sample(Prompt(text=""), [d.tokens[0]], response_ids=d.targets, loss_mask=[1] * len(d.targets))
        for d in data
    ]


class ServeTrainer(TrainActor):
    def __init__(self, cfg: Config, rank: int, threads: int):
        super().__init__(cfg, rank, threads, keep_ref=False)

    def reset(self, cfg: Config) -> str:
        """A fresh model: the base at model.path with new adapters (train.lora), a new optimizer
        -> the tokenizer's directory, for clients that load it."""
        self.cfg = cfg
        self.trainer = build_trainer(cfg, self.tokenizer, keep_ref=False)
        self.plan = _plan(cfg, self.trainer.pushed_weights())
        self.transport = None
        return self.tokenizer.name_or_path

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict, backward: bool
    ) -> tuple[list[dict[str, list[float]]], dict[str, float]]:
        """The loss's forward (and with `backward` its backward, gradients added to those of the
        calls since the last optim_step) -> each datum's {"logprobs": per target} and the metrics
        ("loss:sum", Tinker's reduction suffix)."""
        learner, loss_of = self.trainer.learner, LOSSES.get(loss_fn)
        samples = as_samples(data)
        width = max(len(d.targets) for d in data)
        inputs = {k: pad_rows([d.inputs[k] for d in data], width) for k in data[0].inputs}
        mask = pad_rows([[1.0] * len(d.targets) for d in data], width)

        def micro_loss(part: list[int]):
            rows = learner.rows([samples[i] for i in part or [0]], 1.0)  # logprobs at temperature 1
            logp, _ = score(learner.module, rows, width)
            if not part:  # a dummy micro-batch (another rank's share): adds nothing
                return logp.sum() * 0.0, {}, None
            mine = {k: v[part].to(logp.device) for k, v in inputs.items()}
            loss = (loss_of(logp, mine, config) * mask[part].to(logp.device)).sum()
            return loss, {"loss:sum": float(loss.detach())}, logp.detach().cpu()

        # Tinker adds the gradients of every forward_backward until optim_step (which clears them).
        sums, outputs = learner.accumulate(samples, micro_loss, backward=backward, fresh=False)
        logp = torch.zeros(len(samples), width)
        for part, out in outputs:
            logp[part] = out
        per_datum = [{"logprobs": logp[i, : len(d.targets)].tolist()} for i, d in enumerate(data)]
        return per_datum, {"loss:sum": sums.get("loss:sum", 0.0)}

    def optim_step(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, clip: float
    ) -> dict:
        """One AdamW step on the accumulated gradients with the client's parameters (grad clip 0:
        none) -> metrics; the gradients are cleared."""
        learner = self.trainer.learner
        for group in learner.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        learner.cfg = dataclasses.replace(learner.cfg, grad_clip=clip)
        norm = learner.step()
        learner.optimizer.zero_grad(set_to_none=True)
        self.trainer.version += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    def drop_optimizer_state(self) -> None:
        """After a load without the optimizer (TrainingClient.load_state): AdamW starts afresh."""
        self.trainer.learner.optimizer.state.clear()


class ServeRollout(RolloutActor):
    def reset(self, cfg: Config) -> None:
        """An engine for a fresh model (its adapters' shapes from train.lora), at version 0."""
        self.cfg = cfg
        self.worker, _ = build_rollout(cfg)
        self.params = self.worker.engine.named_weights()
        self.plan = _plan(cfg, self.params.items())
        self.staging = StagingBuffer(self.plan)
        self.transport = None

    def sample(self, requests: list[tuple[list[int], int, int, int | None]], params: SamplingParams) -> list:
        """Requests of (prompt tokens, samples, max new tokens, seed) sampled in one generate call
        -> per request its `Sequence`s. The weights are the newest pushed (`apply_pending`)."""
        self.worker.apply_pending()
        samples = []
        for g, (prompt, n, max_tokens, seed) in enumerate(requests):
            for i in range(n):
                s = Sample(Prompt(text=""), list(prompt), group_id=g, index=i, max_new_tokens=max_tokens)
                s.seed = None if seed is None else seed + i  # one seed each, or a request's samples agree
                samples.append(s)
        done = self.worker.generate(samples, params)
        out: list[list[Sequence]] = [[] for _ in requests]
        for s in done:
            reason = "length" if s.finish_reason == "length" else "stop"
            out[s.group_id].append(Sequence(s.response_ids, s.logprobs, reason))
        return out

    def prompt_logprobs(self, tokens: list[int]) -> list[float | None]:
        """Each prompt token's logprob given those before it, under the served weights (None for the
        first). Built-in engines only: they expose their model."""
        model = getattr(self.worker.engine, "model", None)
        if model is None:
            raise TandemError(
                f"Prompt logprobs need a built-in engine; rollout.engine={self.cfg.rollout.engine}."
            )
        self.worker.apply_pending()
        sample = Sample(Prompt(text=""), tokens[:1], response_ids=tokens[1:])
        logp = sequence_logprobs(model, [sample], len(tokens), 1.0)[0]
        return [None] + logp[: len(tokens) - 1].tolist()


@dataclasses.dataclass
class Workers:
    """The service's clusters (one per worker in one process; one Ray cluster for both), and the
    call that waits on them."""

    train: "LocalCluster | RayCluster"
    rollout: "LocalCluster | RayCluster"
    timeout_s: float

    def call(self, cluster, worker: str, method: str, *args):
        """`worker.method(*args)` on its cluster, waited for (run it off the event loop)."""
        return cluster.get([cluster.submit(worker, method, *args)], self.timeout_s)[0]

    def push(self, version: int) -> None:
        """The trainer's weights (a LoRA model's adapters) to the engine as `version`, in buckets,
        as `tandem train` pushes them: no file in between."""
        sent = self.call(self.train, "train/0", "send_weights", version)
        self.call(self.rollout, "rollout/0", "receive_weights", sent, version)
        self.call(self.rollout, "rollout/0", "apply_pending")

    def close(self) -> None:
        if not isinstance(self.train, LocalCluster):  # Ray: the actors go, and Ray if started here
            import ray

            self.train.close()
            ray.shutdown()
            return
        # LocalCluster.close also stops a reward pool and an agent, which the service has none of:
        # its call threads end at the sentinel.
        self.train.calls.put(None)
        self.rollout.calls.put(None)


def resolve(cfg: Config) -> Config:
    """The config as `tandem train` resolves it: absolute paths, run.device and the dtypes concrete."""
    return devices.resolve(with_absolute_paths(cfg), torch.cuda.device_count(), "this machine")


def start_workers(cfg: Config) -> Workers:
    """The trainer and the engine of a resolved config, each on a call thread of its own, with
    every CPU thread (run.threads to share them out)."""
    load_checked_tokenizer(cfg)  # a bad tokenizer fails here, once
    if cfg.train.num_workers > 1 or cfg.rollout.num_workers > 1:
        raise TandemError(
            f"tandem serve runs one trainer and one engine; train.num_workers={cfg.train.num_workers} "
            f"and rollout.num_workers={cfg.rollout.num_workers} ask for more. Set both to 1."
        )
    # Ray when asked for (run.cluster=ray) or when one process cannot hold the settings; not merely
    # because Ray runs in this process already (a test session's), as `tandem train`'s auto would.
    if cfg.run.cluster == "ray" or (cfg.run.cluster == "auto" and one_process_refusal(cfg)):
        from tandem.runtime.cluster import RayCluster

        cluster = RayCluster.start(cfg, {"train": ServeTrainer, "rollout": ServeRollout})
        return Workers(cluster, cluster, cfg.run.timeout_s)
    threads = cfg.run.threads or cpu_threads()
    train = LocalCluster({"train/0": ServeTrainer(cfg, 0, threads)}, {"train": ["train/0"]}, threads)
    rollout = LocalCluster({"rollout/0": ServeRollout(cfg, 0, threads)}, {"rollout": ["rollout/0"]}, threads)
    return Workers(train, rollout, cfg.run.timeout_s)
