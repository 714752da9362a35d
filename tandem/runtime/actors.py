"""The roles as workers the loop calls: each wraps the plain role object, times its work as
`Span`s, and is built from the run's config. `RayCluster` makes each a Ray actor in a process of
its own (placement decides its CPUs and threads); `LocalCluster` (`tandem.runtime.local`) holds
them as they are, in the driver's process.

Rollout actors have two concurrency groups: "gen" runs generate calls one after another, "weights"
receives pushes while generation goes on (they are staged; the engine swaps at a safe point chosen
by `rollout.on_update`).
"""

import time
from pathlib import Path

import torch

from tandem.config import Config
from tandem.controller.timeline import Span
from tandem.data.tokenizer import load_tokenizer
from tandem.determinism import make_deterministic
from tandem.dtypes import DTYPES
from tandem.model.config import model_dir, resolve_model_path
from tandem.reward import RewardPool, load_reward_fn
from tandem.reward.judge import JudgeWorker
from tandem.reward.shaping import overlong_penalty
from tandem.rollout.engine import BuiltinEngine
from tandem.runtime.memory import process_peak
from tandem.runtime.role_table import ref_count
from tandem.runtime.roles import (
    build_critic,
    build_rollout,
    build_trainer,
    load_checked_tokenizer,
    load_policy,
    pad_token_id,
    save_hf_model,
)
from tandem.sample import Sample, SamplingParams
from tandem.sync import TRANSPORTS, BucketPlan, StagingBuffer, init_world, new_group, sync_group
from tandem.train.ref import RefWorker
from tandem.train.state import CRITIC, load_state, save_state


def bucket_plan(cfg: Config, named) -> BucketPlan:
    """The same plan on both sides: the trainer's fp32 masters travel in the engines' dtype."""
    s = cfg.sync
    return BucketPlan.from_named_tensors(
        named, s.produce_bucket_mb, s.consume_bucket_mb, DTYPES[cfg.rollout.dtype]
    )


def _transport(actor, plan: BucketPlan):
    """The run's weight transport, as seen from this actor (sender or receiver side)."""
    factory = TRANSPORTS.get(actor.cfg.sync.transport)
    group = getattr(actor, "sync_group", None)
    s = actor.cfg.sync
    return factory(plan, actor.name, group=group, src_rank=0, timeout_s=s.timeout_s, delta=s.delta)


def _set_up_process(cfg: Config, threads: int) -> None:
    """An actor's process, before it builds anything: its torch threads (placement's share unless
    run.threads), and with run.deterministic seeded RNGs and deterministic algorithms."""
    torch.set_num_threads(cfg.run.threads or threads)
    if cfg.run.deterministic:
        make_deterministic(cfg.run.seed)


def group(name: str):
    """Marks a rollout method's Ray concurrency group ("gen": generate calls one after another;
    "weights": pushes received beside them); `RayCluster` applies it. Ray itself is imported only
    where it runs the workers: a run in one process never imports it."""

    def mark(method):
        method.concurrency_group = name
        return method

    return mark


class _Timed:
    name = "worker"

    def ready(self) -> float:
        """Now: called as soon as the worker is built, the end of its start-up (`RayCluster`)."""
        return time.time()

    def _span(self, kind: str, start: float) -> Span:
        return Span(kind, self.name, start, time.time())

    def peak_memory(self) -> tuple[int, float]:
        """(this worker's process id, its peak memory in GB) (`memory.process_peak`)."""
        return process_peak()


class _DistMember:
    """Joins torch.distributed: the trainers' world (data-parallel ranks 0..T-1) and, under the
    broadcast transport, the weight-sync group (the trainer's rank 0 and the rollout workers)."""

    def join(self, rank: int, world: int, addr: str, port: int) -> bool:
        # On GPUs, CUDA tensors go over NCCL and CPU tensors (metrics) over gloo, in the same groups.
        backend = "cpu:gloo,cuda:nccl" if self.cfg.run.device == "cuda" else "gloo"
        init_world(rank, world, addr, port, backend=backend, timeout_s=self.cfg.sync.timeout_s)
        self.dp_group = new_group(list(range(world)))
        return True

    def join_sync(self, rank: int, size: int, addr: str, port: int) -> bool:
        self.sync_group = sync_group(rank, size, addr, port, self.cfg.run.device, self.cfg.sync.timeout_s)
        return True


class RolloutActor(_Timed, _DistMember):
    def __init__(self, cfg: Config, rank: int, threads: int):
        _set_up_process(cfg, threads)
        self.rank, self.name = rank, f"rollout/{rank}"
        self.rebuild(cfg)

    def rebuild(self, cfg: Config) -> None:
        """A fresh engine for `cfg` at version 0 (its weights from model.path; a LoRA run's adapter
        shapes from train.lora) and its side of the push plan: at start, and for each new model
        `tandem serve` is asked for."""
        self.cfg, self.worker = cfg, None  # the old engine goes before the new one is built
        self.worker, _ = build_rollout(cfg, self.rank)
        self.params = self.worker.engine.named_weights()
        self.plan = bucket_plan(cfg, self.params.items())
        self.staging = StagingBuffer(self.plan)
        self.transport = None

    @group("weights")
    def join_sync(self, *args) -> bool:
        return _DistMember.join_sync(self, *args)

    @group("weights")
    def receive_weights(self, sent, version: int) -> Span:
        """`sent` is the trainer's (handle, span) for the object store, None for broadcast."""
        start = time.time()
        handle = sent[0] if sent is not None else None
        if self.transport is None:
            self.transport = _transport(self, self.plan)
        self.transport.receive(handle, version, self.staging, self.cfg.sync.timeout_s)
        self.worker.set_pending_update(version, lambda: self.staging.swap_into(self.params, version))
        return self._span("sync", start)

    @group("gen")
    def generate(self, samples: list[Sample], params: SamplingParams, kind: str = "generate"):
        start = time.time()
        out = self.worker.generate(samples, params)
        return out, self._span(kind, start)

    @group("gen")
    def sleep(self) -> tuple[dict[str, float], Span]:
        """After the generate calls before it: free the engine's weights and KV cache for the
        trainer (rollout.free_memory_during_train); the next generate call wakes it."""
        start = time.time()
        metrics = self.worker.engine.sleep()
        return metrics, self._span("sleep", start)

    @group("gen")
    def rng_state(self) -> torch.Tensor | None:
        """After the generate calls before it: the engine's sampling stream, for a checkpoint."""
        return self.worker.engine.rng_state()

    @group("gen")
    def set_rng_state(self, state: torch.Tensor) -> None:
        self.worker.engine.set_rng_state(state)

    @group("gen")
    def apply_pending(self) -> int:
        self.worker.apply_pending()
        return self.worker.version

    def close(self) -> None:
        """Stop an agent's endpoint (the one-process cluster's end; on Ray the process's end does)."""
        close_agent = getattr(self.worker.agent, "close", None)
        if close_agent is not None:
            close_agent()

    @group("gen")
    def weights(self, served: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, what pushes write: the engine's parameters, a LoRA run's adapters), for checks
        that weights arrived bit for bit; `served`: a built-in engine's model as it computes (the
        adapters merged in)."""
        params = dict(self.worker.engine.model.named_parameters()) if served else self.params
        return self.worker.version, {n: p.detach().clone() for n, p in params.items()}


class TrainActor(_Timed, _DistMember):
    def __init__(self, cfg: Config, rank: int, threads: int, keep_ref: bool | None = None):
        """keep_ref: whether the trainer keeps its own reference copy (default: when the run has no
        reference worker)."""
        _set_up_process(cfg, threads)
        self.rank, self.name = rank, f"train/{rank}"
        self.keep_ref = ref_count(cfg) == 0 if keep_ref is None else keep_ref
        self.tokenizer = load_checked_tokenizer(cfg)
        self.rebuild(cfg)

    def rebuild(self, cfg: Config) -> None:
        """A fresh trainer for `cfg` (the weights of model.path, new adapters of train.lora's shape,
        a new optimizer, version 0) and its side of the push plan: at start, and for each new model
        `tandem serve` is asked for."""
        self.cfg, self.trainer = cfg, None  # the old trainer goes before the new one is built
        self.trainer = build_trainer(cfg, self.tokenizer, keep_ref=self.keep_ref)
        self.plan = bucket_plan(cfg, self.trainer.pushed_weights())
        self.transport = None

    def join(self, *args) -> bool:
        _DistMember.join(self, *args)
        self.trainer.parallelize(self.dp_group)
        return True

    def train_step(self, samples: list[Sample]) -> tuple[dict[str, float], list[Span]]:
        start = time.time()
        metrics = self.trainer.train_step(samples)
        end = time.time()
        spans = [Span("train", self.name, start, end)]
        logp = metrics.get("timing_s/logp", 0.0)
        if logp:
            spans.insert(0, Span("logp", self.name, start, start + logp))
        return metrics, spans

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights, whole, on the CPU (every rank calls it: fsdp2 gathers the shards)."""
        return self.trainer.full_weights()

    def send_weights(self, version: int):
        """Every rank: rank 0 pushes the policy's weights (a LoRA run's adapters only), one bucket at
        a time; under fsdp2 the others take part in gathering each tensor from the shards. -> (the
        transport's handle or None, span)."""
        start = time.time()
        if self.rank > 0:
            self.trainer.gather_weights([slot.spec.name for b in self.plan.buckets for slot in b])
            return None, self._span("sync", start)
        if self.transport is None:
            self.transport = _transport(self, self.plan)
        handle = self.transport.send(self.trainer.pushed_weights(), version)
        return handle, self._span("sync", start)

    def save(self, path: str) -> Span:
        """Every rank, into a checkpoint's temporary directory: the Hugging Face weights (rank 0
        writes what all gather) and this rank's resumable state (`tandem.train.state`)."""
        start = time.time()
        base = resolve_model_path(self.cfg.model.path).resolve()  # a LoRA adapter's base
        save_hf_model(self.trainer, self.tokenizer, Path(path), str(base))
        save_state(self.trainer, Path(path))
        return self._span("save", start)

    def load(self, path: str) -> int:
        """Every rank, after `join`: continue from a checkpoint -> the policy version it holds."""
        load_state(self.trainer, Path(path))
        return self.trainer.version


class RefActor(_Timed):
    """The reference policy's logprobs of every sampled token, at the sampling temperature."""

    role, into = "ref", "ref_logprobs"  # its name and span, and the Sample field it fills

    def __init__(self, cfg: Config, rank: int, threads: int):
        _set_up_process(cfg, threads)
        self.name = f"{self.role}/{rank}"
        model = load_policy(cfg, cfg.train.dtype, path=self.model_path(cfg))  # frozen: no rounding lost
        self.worker = RefWorker(model, cfg.train.micro_batch_tokens, cfg.rollout.temperature, self.into)

    def model_path(self, cfg: Config) -> str:
        return ""  # the policy's start (model.path)

    def score(self, samples: list[Sample]) -> tuple[list[Sample], Span]:
        start = time.time()
        return self.worker.score(samples), self._span(self.role, start)


class TeacherActor(RefActor):
    """On-policy distillation's teacher (algo.distill.teacher): the reference worker on the
    teacher's model, its logprobs into `Sample.teacher_logprobs`."""

    role, into = "teacher", "teacher_logprobs"

    def model_path(self, cfg: Config) -> str:
        return cfg.algo.distill.teacher


class JudgeActor(_Timed):
    """reward.fn=judge: a generative reward model on a built-in engine of its own
    (`tandem.reward.judge`); it answers the training reward calls, the reward actor the held-out ones."""

    def __init__(self, cfg: Config, rank: int, threads: int):
        _set_up_process(cfg, threads)
        self.name = f"judge/{rank}"
        judge = cfg.reward.judge
        model = load_policy(cfg, cfg.rollout.dtype, path=judge.path)
        tokenizer = load_tokenizer(model_dir(judge.path))
        engine = BuiltinEngine(model, [tokenizer.eos_token_id], pad_token_id(tokenizer), seed=cfg.run.seed)
        verifier = load_reward_fn(judge.verifier)
        positions = model.cfg.max_position_embeddings
        self.worker = JudgeWorker(engine, tokenizer, judge, verifier, positions)

    def score(self, samples: list[Sample], kind: str = "reward"):
        """The judge's rewards, as `RewardActor.score` gives the verifier's: (samples, counters, span)."""
        start = time.time()
        metrics = self.worker.score(samples)
        return samples, metrics, self._span("judge", start)


class CriticActor(_Timed, _DistMember):
    """PPO's value model (`tandem.train.critic`): values and GAE before the policy's step, its own
    update beside it. Its ranks form a torch.distributed world of their own (`join`)."""

    def __init__(self, cfg: Config, rank: int, threads: int):
        _set_up_process(cfg, threads)
        self.cfg, self.rank, self.name = cfg, rank, f"critic/{rank}"
        self.critic = build_critic(cfg, load_checked_tokenizer(cfg))

    def join(self, *args) -> bool:
        _DistMember.join(self, *args)
        self.critic.parallelize(self.dp_group)
        return True

    def estimate(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float], Span]:
        """Every rank, each on its share of the values; all get the same advantages."""
        start = time.time()
        metrics = self.critic.estimate(samples)
        return samples, metrics, self._span("values", start)

    def train_step(self, samples: list[Sample]) -> tuple[dict[str, float], list[Span]]:
        start = time.time()
        metrics = self.critic.train_step(samples)
        return metrics, [self._span("critic", start)]

    def save(self, path: str) -> Span:
        start = time.time()
        save_state(self.critic, Path(path), CRITIC)
        return self._span("save", start)

    def load(self, path: str) -> int:
        load_state(self.critic, Path(path), CRITIC)
        return self.critic.version


class RewardActor(_Timed):
    def __init__(self, cfg: Config, rank: int = 0, threads: int = 0):
        """Its threads are the pool's processes' (reward.num_workers), not torch's."""
        self.name = f"reward/{rank}"
        # What the reward function prints goes to the run directory, a bounded head per call.
        output_log = Path(cfg.run.out_dir) / cfg.run.name / "reward_output.log"
        self.pool = RewardPool.from_config(cfg.reward, output_log)
        self.max_length, self.reward = cfg.rollout.max_new_tokens, cfg.reward

    def score(self, samples: list[Sample], kind: str = "reward"):
        """Verifier rewards; training samples ("reward") then take the overlong shaping, held-out
        ones ("val_reward") stay as verified, so accuracy means accuracy."""
        start = time.time()
        metrics = self.pool.score(samples)
        if kind == "reward" and self.reward.overlong_buffer:
            buffer, factor = self.reward.overlong_buffer, self.reward.overlong_penalty
            for s in samples:
                penalty = overlong_penalty(len(s.response_ids), self.max_length, buffer, factor)
                s.reward += penalty
                s.reward_parts["overlong_penalty"] = penalty  # logged as reward/overlong_penalty/mean
        return samples, metrics, self._span(kind, start)

    def close(self) -> None:
        self.pool.close()
