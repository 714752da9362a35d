"""The service's two workers: tandem's train and rollout actors, with the calls the Tinker API
makes of them, reached through the cluster interface `tandem train` uses
(`tandem.controller.protocol.Cluster`).

`ServeTrainer` is a `TrainActor` (a `TrainWorker` and its `Learner`): a forward_backward is the
learner's micro-batched forward and backward under one of `tandem.serve.losses`, with the
gradients accumulated until optim_step, which steps AdamW with the client's parameters; weights
reach the engine by the actor's own versioned push (`send_weights` / `receive_weights`), and state
saves and loads are the actor's checkpoints (`save` / `load`: weights, optimizer, schedule, RNGs).
`ServeRollout` is a `RolloutActor`: sampling is its worker's generate call, over rows of several
samplers' adapters where the engine mixes them (`mixes_rows`; then the trainer computes the same
unmerged form in the batch-invariant mode, `tandem.model.lora.set_lora_form`).

In one process (run.cluster auto or local), each worker gets a `LocalCluster` of its own (one
call thread each, calls in order), so a sample runs while a forward_backward runs, on threads of
one process. With run.cluster=ray both are Ray actors of one `RayCluster`, placed as `tandem
train`'s are (placement.*, ray.address to join a cluster of several machines): the roles table's
trainer and engine rows, built as these subclasses.
"""

import dataclasses
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from tandem.config import Config
from tandem.dtypes import DTYPES
from tandem.errors import TandemError
from tandem.model.lora import fresh_adapters, set_lora_form
from tandem.rollout.engines import ENGINES
from tandem.runtime.actors import RolloutActor, TrainActor
from tandem.runtime.startup import build_cluster, place
from tandem.sample import Prompt, Sample, SamplingParams
from tandem.serve.losses import LOSSES
from tandem.serve.wire import Datum, Sequence
from tandem.train.batch import pad_rows, score, sequence_logprobs

if TYPE_CHECKING:  # imported where a run on Ray starts: one process never loads Ray
    from tandem.runtime.cluster import RayCluster
    from tandem.runtime.local import LocalCluster


def with_lora(cfg: Config, rank: int, seed: int, attn: bool, mlp: bool, unembed: bool = False) -> Config:
    """The service's config for a model of LoRA rank `rank` (0: every weight trains) on the
    attention and/or MLP projections and/or the LM head (Tinker's train_unembed). The service's
    rows are whole sequences each, so the learner never packs neighbours as one shared prompt
    (train.share_prompts)."""
    targets = [
        *(["q_proj", "k_proj", "v_proj", "o_proj"] if attn else []),
        *(["gate_proj", "up_proj", "down_proj"] if mlp else []),
        *(["lm_head"] if unembed else []),
    ]
    lora = dataclasses.replace(cfg.train.lora, rank=rank, target_modules=targets)
    train = dataclasses.replace(cfg.train, lora=lora, share_prompts=False)
    return dataclasses.replace(cfg, train=train, run=dataclasses.replace(cfg.run, seed=seed))


def mixes_rows(cfg: Config) -> bool:
    """Whether the service's engine runs rows of several samplers' adapters in one call: a LoRA
    model's (rank > 0) on an engine whose spec mixes them (the built-in one), its projections fused
    (rollout.quantization=none), its adapters alone (no train.lora.modules_to_save: a module
    trained whole cannot differ by row). Otherwise each sampler's requests run as a call of their
    own, its weights merged."""
    c, r = cfg.train.lora, cfg.rollout
    return (
        bool(c.rank)
        and not c.modules_to_save
        and ENGINES.get(r.engine).mixes_adapters
        and r.quantization == "none"
    )


def as_samples(data: list[Datum]) -> list[Sample]:
    """Tinker datums as tandem samples: the first input token is the prompt, the targets the
    response (the input shifted by one), so the trainer scores every target position."""
    return [
        Sample(Prompt(text=""), [d.tokens[0]], response_ids=d.targets, loss_mask=[1] * len(d.targets))
        for d in data
    ]


class ServeTrainer(TrainActor):
    """The service's trainer. Several models (the service's clients) train on one base in turn:
    each has its own adapters, accumulated gradients, AdamW moments and version, put into the
    learner for its own calls and parked beside it otherwise (`Learner.take_trainable` /
    `put_trainable`). A full-weights model (LoRA rank 0) is the only one."""

    def __init__(self, cfg: Config, rank: int, threads: int):
        super().__init__(cfg, rank, threads, keep_ref=False)
        self.parked: dict[str, tuple[dict, int]] = {}  # model id -> (its trainables, its version)
        self.active: str | None = None  # whose trainables the learner holds

    def reset(self, cfg: Config) -> str:
        """A fresh trainer for `cfg` (the base at model.path, train.lora's adapter shape), no model
        on it yet -> the tokenizer's directory, for clients that load it."""
        self.rebuild(cfg)
        if mixes_rows(cfg):  # the engine's form, so that run.deterministic's logprobs agree exactly
            learner = self.trainer.learner
            for model in {id(m): m for m in (learner.model, learner.compute)}.values():
                set_lora_form(model, "unmerged")
        self.parked.clear()
        self.active = None
        return self.tokenizer.name_or_path

    def add_model(self, model_id: str, seed: int) -> None:
        """A new model: fresh adapters drawn from `seed` as `apply_lora` draws them (a full-weights
        model: the base as `reset` loaded it), fresh AdamW, version 0."""
        self._park()
        learner = self.trainer.learner
        if self.cfg.train.lora.rank:
            learner.put_trainable({n: (v, None, {}) for n, v in fresh_adapters(learner.model, seed).items()})
        self.trainer.version = 0
        self.active = model_id

    def drop_model(self, model_id: str) -> None:
        self.parked.pop(model_id, None)
        if self.active == model_id:
            self.active = None  # its values stay in the learner until the next model's go in

    def use(self, model_id: str) -> None:
        """The learner holds `model_id`'s trainables (and its version) from here on."""
        if self.active == model_id:
            return
        if model_id not in self.parked:
            raise TandemError(f"No model {model_id!r} on the trainer (closed, or its session ended).")
        self._park()
        taken, self.trainer.version = self.parked.pop(model_id)
        self.trainer.learner.put_trainable(taken)
        self.active = model_id

    def _park(self) -> None:
        if self.active is not None:
            self.parked[self.active] = (self.trainer.learner.take_trainable(), self.trainer.version)
            self.active = None

    def snapshot(self, model_id: str) -> dict[str, torch.Tensor]:
        """What a push would send of `model_id` (its adapters; a full-weights model's every weight),
        in the engine's dtype: a sampler's weights."""
        self.use(model_id)
        dtype = DTYPES[self.cfg.rollout.dtype]
        return {n: t.detach().to(dtype).clone() for n, t in self.trainer.pushed_weights()}

    def save_model(self, model_id: str, path: str):
        self.use(model_id)
        return self.save(path)

    def load_model(self, model_id: str, path: str, optimizer: bool) -> int:
        """`model_id` continues from the checkpoint at `path`; without `optimizer` AdamW restarts."""
        self.use(model_id)
        version = self.load(path)
        if not optimizer:
            self.trainer.learner.forget_optimizer_state()
        return version

    def forward_backward(
        self, model_id: str, data: list[Datum], loss_fn: str, config: dict, backward: bool
    ) -> tuple[list[dict[str, list[float]]], dict[str, float]]:
        """`model_id`'s loss forward (and with `backward` its backward, gradients added to those of
        its calls since its last optim_step) -> each datum's {"logprobs": per target} and the
        metrics ("loss:sum", Tinker's reduction suffix)."""
        self.use(model_id)
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

    def optim_step(self, model_id: str, hyper: dict) -> dict:
        """One AdamW step on `model_id`'s accumulated gradients with the client's hyper-parameters
        (`Learner.set_hyperparameters`' arguments; grad_clip 0: none) -> metrics; the gradients are
        cleared."""
        self.use(model_id)
        norm = self.trainer.step_accumulated(hyper)
        lr = hyper["lr"]
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}


class ServeRollout(RolloutActor):
    def reset(self, cfg: Config) -> bool:
        """An engine for a fresh model shape (its adapters' from train.lora), at version 0 -> whether
        it runs rows of several adapters in one call (`mixes_rows`)."""
        self.rebuild(cfg)
        return mixes_rows(cfg)

    def serve_adapters(self, named: dict[str, dict[str, torch.Tensor]]) -> int:
        """From the next sample on, the engine computes with the base's weights and holds `named`'s
        adapters (sampler weights name -> what a push of its model sends), which each request of a
        sample call may name -> the engine's new version."""
        version = self.worker.version + 1
        self.worker.engine.load_adapters(named, version)
        return version

    def serve_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """From the next sample on, the engine computes with `weights` (a sampler's: what a push of
        its model sends, `ServeTrainer.snapshot`) -> the engine's new version."""
        version = self.worker.version + 1

        def apply() -> None:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(weights[name])

        self.worker.set_pending_update(version, apply)
        self.worker.apply_pending()
        return version

    def sample(
        self, requests: list[tuple[list[int], int, int, int | None, str | None]], params: SamplingParams
    ) -> list:
        """Requests of (prompt tokens, samples, max new tokens, seed, adapter) sampled in one generate
        call -> per request its `Sequence`s, under the weights last served (`serve_weights`), each
        request's rows with its adapter of the table `serve_adapters` gave (None: none)."""
        samples = []
        for g, (prompt, n, max_tokens, seed, adapter) in enumerate(requests):
            for i in range(n):
                s = Sample(Prompt(text=""), list(prompt), group_id=g, index=i, max_new_tokens=max_tokens)
                s.seed = None if seed is None else seed + i  # one seed each, or a request's samples agree
                s.adapter = adapter
                samples.append(s)
        done = self.worker.generate(samples, params)
        out: list[list[Sequence]] = [[] for _ in requests]
        for s in done:
            reason = "length" if s.finish_reason == "length" else "stop"
            out[s.group_id].append(Sequence(s.response_ids, s.logprobs, reason))
        return out

    def prompt_logprobs(self, tokens: list[int], adapter: str | None = None) -> list[float | None]:
        """Each prompt token's logprob given those before it, under the served weights (with
        `adapter` of the table, as `sample` takes it) (None for the first). Built-in engines only:
        they expose their model."""
        engine = self.worker.engine
        if getattr(engine, "model", None) is None:
            raise TandemError(
                f"Prompt logprobs need a built-in engine; rollout.engine={self.cfg.rollout.engine}."
            )
        sample = Sample(Prompt(text=""), tokens[:1], response_ids=tokens[1:])
        with engine.adapter_rows([adapter]):
            logp = sequence_logprobs(engine.model, [sample], len(tokens), 1.0)[0]
        return [None] + logp[: len(tokens) - 1].tolist()


@dataclasses.dataclass
class Workers:
    """The service's clusters (one per worker in one process, so that a sample runs while a train
    call does; one Ray cluster for both), and the call that waits on them. `cfg`: the config they
    were built with (device and dtypes concrete); `stack` stops a Ray started for them."""

    cfg: Config
    train: "LocalCluster | RayCluster"
    rollout: "LocalCluster | RayCluster"
    stack: ExitStack

    def call(self, role: str, method: str, *args):
        """`method(*args)` on the role's worker, waited for (run it off the event loop)."""
        cluster = self.train if role == "train" else self.rollout
        worker = cluster.names[role][0]
        return cluster.get([cluster.submit(worker, method, *args)], self.cfg.run.timeout_s)[0]

    def close(self) -> None:
        self.train.close()
        if self.rollout is not self.train:
            self.rollout.close()
        self.stack.close()  # Ray, if started here


def start_workers(cfg: Config) -> Workers:
    """The trainer and the engine of a config `tandem.runtime.startup.place` resolved, built through
    the roles table as `ServeTrainer` and `ServeRollout`: in this process, each on a call thread of
    its own with every CPU thread (run.threads to share them out), or on Ray when asked for
    (run.cluster=ray) or when one process cannot hold the settings."""
    if cfg.train.num_workers > 1 or cfg.rollout.num_workers > 1:
        raise TandemError(
            f"tandem serve runs one trainer and one engine; train.num_workers={cfg.train.num_workers} "
            f"and rollout.num_workers={cfg.rollout.num_workers} ask for more. Set both to 1."
        )
    stack = ExitStack()
    # Not merely because Ray runs in this process already (a test session's), as `tandem train`'s
    # auto would: Ray only where it is asked for or needed.
    cfg, local = place(cfg, stack, join_running_ray=False)
    classes = {"train": ServeTrainer, "rollout": ServeRollout}
    if not local:
        cluster = build_cluster(cfg, local, classes)
        return Workers(cfg, cluster, cluster, stack)
    train = build_cluster(cfg, local, classes, only=["train"])
    rollout = build_cluster(cfg, local, classes, only=["rollout"])
    return Workers(cfg, train, rollout, stack)
