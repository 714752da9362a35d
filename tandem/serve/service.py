"""What the service holds between requests, with no HTTP in it: sessions, the training models,
the samplers (`tandem.serve.sampling`), and the futures the SDK polls.

Every call that does work returns a request id at once; the work runs later and its result (or
error) lands in that request's future, which `retrieve_future` waits on. Each training model's
requests run one at a time in the order of their seq_id (the SDK numbers a training client's
requests; a chunked forward_backward may arrive out of order); sample requests queue apart and
run batched, so sampling goes on while a training request runs on the other worker.

Several training models, one per client, share the base: each a LoRA adapter of its own with its
own AdamW state, trained in turn on the one trainer (`ServeTrainer` swaps them in per call); their
requests reach the trainer in the order they come, so no client waits for another's whole loop.
All live models have one adapter shape (rank and targets: what the trainer and the engine are
built for); a model of another shape waits until none is live, and is refused meanwhile, by name.
With --full-weights every weight trains: one model at a time. A session that finished or went
silent for `SESSION_TIMEOUT_S` frees its models.

Whatever a request's check or work raises ends that request, never the queue: a TandemError in its
check is the client's fault (HTTP 400), anything else the service's (its future fails, category
"server"), and the model's later requests run either way.
"""

import asyncio
import dataclasses
import heapq
import itertools
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tandem.config import Config
from tandem.errors import TandemError
from tandem.model.config import ModelConfig, model_dir
from tandem.runtime.startup import resolve_inputs
from tandem.serve import wire
from tandem.serve.checkpoints import Checkpoints, expiry, stamp
from tandem.serve.checks import check_adam, check_tokens
from tandem.serve.futures import Failure, NotFound, fail, failure_of, nothing, settle
from tandem.serve.losses import check_provenance, check_request
from tandem.serve.records import Records
from tandem.serve.runs import Runs
from tandem.serve.sampling import SampleJob, Sampler, Sampling
from tandem.serve.snapshots import Snapshots
from tandem.serve.wire import FwdBwdRequest, forward_backward_output
from tandem.serve.workers import Workers, start_workers, with_lora

SESSION_TIMEOUT_S = 60.0  # the SDK beats every 10 s
KEPT_RESULTS = 4096  # finished futures kept for a retry of their retrieval
MAX_MODELS = 16  # live LoRA models at once: each holds its adapters, gradients and AdamW moments


@dataclasses.dataclass
class Model:
    """A training model: its id, its adapter's shape and seed, and its requests' order."""

    model_id: str
    session_id: str
    base_model: str
    shape: dict  # rank (0: every weight trains), attn, mlp: what the trainer is built for
    seed: int
    tokenizer_dir: str = ""
    next_seq: int = 1
    last_seq: int = 0
    queue: list = dataclasses.field(default_factory=list)  # heap of (seq_id, job)
    requests: dict = dataclasses.field(default_factory=dict)  # seq_id -> its request id
    draining: bool = False  # a task runs its queue
    pushes: int = 0
    last_request: float = 0.0  # seconds since the epoch, for the REST side


class Service:
    def __init__(self, cfg: Config, workers: Workers, full_weights: bool = False, base_model: str = ""):
        """base_model: the name clients give the served model (default: model.path, which start-up
        has made a directory)."""
        self.cfg, self.workers, self.full_weights = cfg, workers, full_weights
        self.base_model = base_model or cfg.model.path
        self.checkpoints = Checkpoints(Path(cfg.run.out_dir) / cfg.run.name)
        self.runs = Runs(self.checkpoints.root)  # every model made, for the REST side
        self.sessions: dict[str, float] = {}  # session id -> last heartbeat (monotonic)
        self.models: dict[str, Model] = {}  # the live ones
        self.shape: dict | None = None  # what the trainer and the engine are built for now
        self.resets = 0
        self.shaping = asyncio.Lock()  # model creations in turn: a reset and its first model together
        self.tokenizer_dir = ""
        root = Path(cfg.run.out_dir) / cfg.run.name
        self.records = Records()  # sequences sampled with record_stability_info
        self.sampling = Sampling(
            self._call, Snapshots(root / "samplers"), self.records, cfg.run.deterministic
        )
        self.results: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.ids = itertools.count(1)
        self.loops: list[asyncio.Task] = []
        model = ModelConfig.load(model_dir(cfg.model.path))
        self.vocab, self.context = model.vocab_size, model.max_position_embeddings
        self.timings: dict[str, float] = {}  # seconds in each worker call (role.method), summed
        self.counts: dict[str, int] = {}  # calls of each (role.method): "rollout.sample" counts generates

    def start(self) -> None:
        """The sampling loop, on the running event loop."""
        self.loops.append(asyncio.create_task(self.sampling.loop()))

    # -- futures ------------------------------------------------------------------------------------
    def _future(self) -> tuple[str, asyncio.Future]:
        request_id = f"req-{next(self.ids)}"
        fut = asyncio.get_running_loop().create_future()
        self.results[request_id] = fut
        while len(self.results) > KEPT_RESULTS and next(iter(self.results.values())).done():
            self.results.popitem(last=False)
        return request_id, fut

    def run(self, work: Callable[[], Awaitable[Any]]) -> str:
        """Start `work` now -> its request id."""
        request_id, fut = self._future()
        asyncio.create_task(settle(fut, work))
        return request_id

    async def result(self, request_id: str, wait_s: float) -> Any:
        """The request's result or `Failure`, waiting up to wait_s; None while it still runs."""
        fut = self.results.get(request_id)
        if fut is None:
            raise NotFound(f"No request {request_id!r} (finished ones are kept for a while, then dropped).")
        try:
            return await asyncio.wait_for(asyncio.shield(fut), wait_s)
        except asyncio.TimeoutError:
            return None

    # -- sessions and the model ---------------------------------------------------------------------
    def create_session(self) -> str:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = time.monotonic()
        return session_id

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise NotFound(f"No session {session_id!r}.")
        self.sessions[session_id] = time.monotonic()

    def finish(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _frees_in(self, model: Model) -> float:
        """Seconds until the model's session frees itself unless it beats again; <= 0: free now."""
        beat = self.sessions.get(model.session_id)
        return -1.0 if beat is None else SESSION_TIMEOUT_S - (time.monotonic() - beat)

    def check_base(self, base_model: str | None) -> str:
        if base_model != self.base_model:
            raise TandemError(
                f"Base model {base_model!r} is not served here; this service serves {self.base_model!r}."
            )
        return base_model

    def model_of(self, model_id: str) -> Model:
        if model_id not in self.models:
            raise NotFound(f"No training model {model_id!r} here (closed, or its session ended).")
        return self.models[model_id]

    def _drop_gone(self) -> None:
        """Free the models whose session finished or went silent: their adapters and moments go."""
        for model in [m for m in self.models.values() if self._frees_in(m) <= 0]:
            del self.models[model.model_id]
            asyncio.create_task(self._call("train", "drop_model", model.model_id))

    def create_model(
        self,
        session_id: str,
        seq: int,
        base: str,
        rank: int,
        seed: int,
        attn: bool,
        mlp: bool,
        unembed: bool = False,
        user_metadata: dict | None = None,
    ) -> str:
        """A new training model -> the request id whose result is its model id; its run recorded
        with the client's `user_metadata`. Refused, naming why and until when, when the live models
        have another adapter shape, a full-weights model is live, or MAX_MODELS are."""
        self.check_base(base)
        self._drop_gone()
        shape = dict(rank=0 if self.full_weights else rank, attn=attn, mlp=mlp, unembed=unembed)
        self._check_room(shape)
        model = Model(f"{session_id}:train:{seq}", session_id, base, shape, seed)
        self.models[model.model_id] = model

        async def work():
            async with self.shaping:
                # No live model of another shape: build for this one. A full-weights model trains the
                # base itself, so each one starts from a fresh trainer.
                if shape != self.shape or self.full_weights:
                    await self._reset(shape, seed)
                await self._call("train", "add_model", model.model_id, seed)
                self.runs.record(model.model_id, session_id, base, shape, user_metadata)
                model.tokenizer_dir = self.tokenizer_dir
                base_key = f"base:{self.resets}"
                if base_key not in self.sampling.snapshots:  # a fresh model's adapters compute the base
                    weights = await self._call("train", "snapshot", model.model_id)
                    self.sampling.snapshots.put(base_key, weights, self.resets)
            return wire.model_created(model.model_id)

        return self.run(work)

    def _check_room(self, shape: dict) -> None:
        live = list(self.models.values())
        if not live:
            return
        left = max(self._frees_in(m) for m in live)
        frees = (
            "Close those ServiceClients; a client whose process has ended (Ctrl-C, a crash) frees its "
            f"models {SESSION_TIMEOUT_S:.0f} s after its last heartbeat (here: within {math.ceil(left)} s)."
        )
        if self.full_weights:
            raise TandemError(
                f"This service trains every weight (--full-weights): one model at a time, and "
                f"{live[0].model_id!r} is live. {frees} Or start another `tandem serve`."
            )
        if shape != live[0].shape:
            have = live[0].shape
            raise TandemError(
                f"The {len(live)} live model(s) here have LoRA rank {have['rank']} on "
                f"{_targets(have)}; the trainer and the engine serve one adapter shape at a time, and "
                f"rank {shape['rank']} on {_targets(shape)} was asked for. Ask for the live shape, or "
                f"wait until those models close. {frees}"
            )
        if len(live) >= MAX_MODELS:
            raise TandemError(
                f"This service holds at most {MAX_MODELS} live models (each its adapters, gradients "
                f"and AdamW moments) and {len(live)} are. {frees}"
            )

    async def _reset(self, shape: dict, seed: int) -> None:
        """Trainer and engine rebuilt for adapters of `shape`: the base with no model on it yet, an
        engine serving nothing."""
        cfg = with_lora(self.cfg, shape["rank"], seed, shape["attn"], shape["mlp"], shape["unembed"])
        self.tokenizer_dir = await self._call("train", "reset", cfg)
        mixes = await self._call("rollout", "reset", cfg)
        self.shape = shape
        self.resets += 1
        self.sampling.reshaped(self.resets, mixes)

    async def _call(self, role: str, method: str, *args):
        start = time.perf_counter()
        try:
            return await asyncio.to_thread(self.workers.call, role, method, *args)
        finally:
            key = f"{role}.{method}"
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start
            self.counts[key] = self.counts.get(key, 0) + 1

    # -- training requests, in seq_id order ---------------------------------------------------------
    def train(
        self,
        model_id: str,
        seq_id: int | None,
        work: Callable[[Model], Awaitable[Any]],
        check: Callable[[], None] = lambda: None,
    ) -> str:
        """Queue `work` on the model's requests at seq_id (None: after the last) -> its request id;
        a seq_id already queued or run is a retry, answered with the first copy's request id.
        `check` refuses a bad request (TandemError, a 400) before it is queued; its seq_id still
        counts as used, since the SDK numbered it, so the requests after it are not held for it.
        Anything else `check` raises is the service's fault: the request's future fails with it
        (an HTTP 500 would have the SDK send the request again, under a seq_id now used)."""
        model = self.model_of(model_id)
        model.last_request = time.time()
        seq = seq_id if seq_id is not None else max(model.last_seq, model.next_seq - 1) + 1
        if seq in model.requests:  # a retry (the SDK numbers each request once): the first's future
            return model.requests[seq]
        model.last_seq = max(model.last_seq, seq)
        request_id, fut = self._future()
        model.requests[seq] = request_id
        try:
            check()
        except Exception as e:
            self._queue(model, seq, request_id, fut, nothing)
            if isinstance(e, TandemError):
                raise
            fail(fut, failure_of(e))
            return request_id
        self._queue(model, seq, request_id, fut, work)
        return request_id

    def _queue(self, model: Model, seq: int, request_id: str, fut: asyncio.Future, work) -> None:
        heapq.heappush(model.queue, (seq, request_id, fut, work))
        if not model.draining:
            model.draining = True
            asyncio.create_task(self._drain(model))

    async def _drain(self, model: Model) -> None:
        """Run the model's queued requests while the next in order is there (a later one waits for
        the gap before it to arrive)."""
        try:
            while model.queue and model.queue[0][0] == model.next_seq:
                _, _, fut, work = heapq.heappop(model.queue)
                await settle(fut, lambda work=work: work(model))
                model.next_seq += 1
        finally:
            model.draining = False

    def forward_backward(self, req: FwdBwdRequest) -> str:
        model = self.model_of(req.model_id)

        def check():
            if req.error or not req.data:
                raise TandemError(req.error or "forward_backward got no data.")
            check_request(req.loss_fn, req.config, [set(d.inputs) for d in req.data])
            check_tokens(req.data, *self.limits())
            # Provenance spans against what the session sampled; a stable_reinforce datum's sampler
            # logprobs become the recorded ones.
            req.data = check_provenance(req.data, self.records.of(model.session_id), req.loss_fn)

        async def work(model: Model):
            args = (req.data, req.loss_fn, req.config, not req.forward_only)
            outputs, metrics = await self._call("train", "forward_backward", model.model_id, *args)
            return forward_backward_output(outputs, metrics)

        return self.train(req.model_id, req.seq_id, work, check)

    def limits(self) -> tuple[int, int]:
        """(vocabulary size, context length) of the served model."""
        return self.vocab, self.context

    def optim_step(self, model_id: str, seq_id: int | None, adam: dict) -> str:
        def check():
            if adam.get("type", "adam") != "adam":
                raise TandemError(f"Only Adam is served, not {adam['type']!r}.")
            check_adam(adam)

        hyper = dict(
            lr=adam.get("learning_rate", 1e-4),
            betas=(adam.get("beta1", 0.9), adam.get("beta2", 0.95)),
            eps=adam.get("eps", 1e-12),
            weight_decay=adam.get("weight_decay", 0.0),
            grad_clip=adam.get("grad_clip_norm", 0.0) or float("inf"),
        )

        async def work(model: Model):
            return wire.optim_stepped(await self._call("train", "optim_step", model.model_id, hyper))

        return self.train(model_id, seq_id, work, check)

    # -- checkpoints and samplers -------------------------------------------------------------------
    def checkpoint(self, path: str) -> tuple[Path, dict]:
        """A save_state path -> its directory and serve.json, the checkpoint checked whole
        (`Checkpoints.find`); NotFound when nothing was saved there."""
        where = self.checkpoints.parse(path)
        meta = self.checkpoints.find(where)
        if meta is None:
            raise NotFound(f"No checkpoint at {path!r} (looked in {where}).")
        return where, meta

    def save_state(
        self,
        model_id: str,
        seq_id: int | None,
        name: str,
        overwrite: bool,
        ttl_seconds: int | None = None,
        user_metadata: dict | None = None,
        kind: str = "weights",
        extra: Callable[[], dict] = dict,
    ) -> str:
        """save_state (kind "weights"; "external_weights": save_weights_external) -> its request id;
        serve.json keeps its expiry, user_metadata and what `extra()` adds (checked with the request:
        a TandemError from it refuses the request) for the REST side."""
        path, where, added = "", Path(), {}  # set by the check

        def check():
            nonlocal path, where, added
            path, where = self.checkpoints.place(model_id, kind, name)
            expiry(ttl_seconds)
            added = extra()
            if not overwrite and self.checkpoints.exists(where):
                raise TandemError(f"Checkpoint {path!r} exists; pass overwrite=True to replace it.")

        async def work(model: Model):
            meta = {"base_model": model.base_model, **model.shape, "seed": model.seed}
            meta |= stamp(ttl_seconds, user_metadata) | added
            with self.checkpoints.writing_to(where, meta) as tmp:  # whole, or the old one stays
                await self._call("train", "save_model", model.model_id, str(tmp))
            return wire.weights_saved(path, kind)

        return self.train(model_id, seq_id, work, check)

    def load_state(self, model_id: str, seq_id: int | None, path: str, optimizer: bool) -> str:
        def check():
            if self.checkpoints.parse(path) not in self.checkpoints.writing:  # else checked in turn
                self.checkpoint(path)

        async def work(model: Model):
            where, _ = self.checkpoint(path)  # again: it may have changed since the request came
            await self._call("train", "load_model", model.model_id, str(where), optimizer)
            return wire.weights_loaded(path, model.model_id)

        return self.train(model_id, seq_id, work, check)

    def create_from_state(
        self, session_id: str, seq: int, path: str, optimizer: bool, user_metadata: dict | None = None
    ) -> str:
        """create_training_client_from_state: a new model shaped as the checkpoint's, then its state."""
        _, meta = self.checkpoint(path)
        shape = (meta["rank"], meta["seed"], meta["attn"], meta["mlp"], meta.get("unembed", False))
        request_id = self.create_model(session_id, seq, meta["base_model"], *shape, user_metadata)
        model, created = self.models[f"{session_id}:train:{seq}"], self.results[request_id]

        async def work():
            made = await created
            if isinstance(made, Failure):
                return made
            where, _ = self.checkpoint(path)
            await self._call("train", "load_model", model.model_id, str(where), optimizer)
            return wire.weights_loaded(path, model.model_id)

        return self.run(work)

    def save_for_sampler(
        self,
        model_id: str,
        seq_id: int | None,
        name: str | None,
        ttl_seconds: int | None = None,
        user_metadata: dict | None = None,
    ) -> str:
        """The model's weights now, kept for sampling (`tandem.serve.snapshots`) -> a sampler for them
        (a path when named, a sampler checkpoint the REST side lists; else a sampling session)."""
        model, path = self.model_of(model_id), None

        def check():
            nonlocal path
            path = self.checkpoints.place(model_id, "sampler_weights", name)[0] if name else None
            expiry(ttl_seconds)

        async def work(model: Model):
            model.pushes += 1
            key = path or f"tinker://{model_id}/sampler_weights/push-{model.pushes}"
            start = time.perf_counter()
            weights = await self._call("train", "snapshot", model.model_id)
            self.timings["push"] = self.timings.get("push", 0.0) + time.perf_counter() - start
            self.sampling.snapshots.put(key, weights, self.resets)
            if path:
                self.sampling.snapshots.name(key, model.model_id, ttl_seconds, user_metadata)
            sampler_id = self.sampling.add(Sampler(model.base_model, key, key, model.session_id))
            return wire.saved_for_sampler(key, sampler_id)

        return self.train(model.model_id, seq_id, work, check)

    def create_sampler(self, model_path: str | None, base_model: str | None, session_id: str = "") -> str:
        if model_path:
            if model_path not in self.sampling.snapshots or model_path.startswith("base:"):
                raise NotFound(f"No sampler weights at {model_path!r} (save_weights_for_sampler makes them).")
            return self.sampling.add(Sampler(self.base_model, model_path, model_path, session_id))
        base = self.check_base(base_model)
        if f"base:{self.resets}" not in self.sampling.snapshots:
            raise TandemError(
                "The base model samples once the service has built its trainer: create a training "
                "client first (the first one builds it), then sample the base."
            )
        return self.sampling.add(Sampler(base, None, f"base:{self.resets}", session_id))

    def sampler(self, sampler_id: str) -> Sampler:
        return self.sampling.get(sampler_id)

    def new_sample(self, sampler_id: str, **fields) -> tuple[str, list[str]]:
        """Queue a sample request -> its request id and its sequences' ids."""
        request_id, future = self._future()
        job = SampleJob(request_id, future, self.sampling.get(sampler_id), **fields)
        self.sampling.queue.put_nowait(job)
        return request_id, [f"{request_id}:{i}" for i in range(job.n)]

    async def close(self) -> None:
        for task in self.loops:
            task.cancel()
        self.workers.close()


def _targets(shape: dict) -> str:
    parts = [
        name
        for name, key in (("attention", "attn"), ("MLP", "mlp"), ("the LM head", "unembed"))
        if shape.get(key)
    ]
    return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)


def open_service(cfg: Config, full_weights: bool = False) -> Service:
    """The service of a loaded config, started as every command starts
    (`tandem.runtime.startup`): its inputs resolved, its trainer and engine built. Clients name
    the base model as the config did (model.path before it became a directory)."""
    workers = start_workers(resolve_inputs(cfg))
    return Service(workers.cfg, workers, full_weights, cfg.model.path)
