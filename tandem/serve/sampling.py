"""The service's samplers and its sample requests, with no HTTP in it.

A sampler names the weights it samples: a snapshot saved by `save_weights_for_sampler` (any model,
any version: `tandem.serve.snapshots`), or the base. Sample requests queue apart from training
requests and run batched: the ones that arrive together (within `GATHER_S` of the first) and share
a sampler's weights and sampling parameters run as one generate call. Requests of several samplers
(several clients' adapters, or one client's versions) run one group after another, the engine
given each group's weights before its call (`ServeRollout.serve_weights`, skipped when it holds
them already): each row is computed with its own sampler's weights exactly as if it were alone.
"""

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable

import numpy as np

from tandem.errors import TandemError
from tandem.sample import SamplingParams
from tandem.serve.futures import NotFound, fail, failure_of
from tandem.serve.losses import Recorded
from tandem.serve.records import Records
from tandem.serve.snapshots import Snapshots
from tandem.serve.wire import sample_response

GATHER_S = 0.01  # how long the first sample request of a burst waits for the rest


@dataclasses.dataclass
class Sampler:
    base_model: str
    model_path: str | None
    weights: str  # the snapshot it samples: "base:<n>" or its model_path
    session_id: str = ""  # whose records its samples are (record_stability_info); "" = nobody's


@dataclasses.dataclass
class SampleJob:
    request_id: str
    future: asyncio.Future
    sampler: Sampler
    prompt: list[int]
    n: int
    max_tokens: int
    seed: int | None
    params: SamplingParams
    prompt_logprobs: bool
    record: bool = False  # record_stability_info: keep each sequence for training requests to name


class Sampling:
    def __init__(self, call: Callable[..., Awaitable], snapshots: Snapshots, records: Records):
        """call: the service's `(role, method, *args)` worker call, awaited."""
        self.call, self.snapshots, self.records = call, snapshots, records
        self.samplers: dict[str, Sampler] = {}
        self.serving: str | None = None  # the snapshot the engine holds
        self.shape = 0  # the trainer shape the engine is built for (the service's reset count)
        self.queue: asyncio.Queue[SampleJob] = asyncio.Queue()

    def add(self, sampler: Sampler) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = sampler
        return sampler_id

    def get(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise NotFound(f"No sampler {sampler_id!r}.")
        return self.samplers[sampler_id]

    def reshaped(self, shape: int) -> None:
        """The engine was rebuilt for trainer shape `shape`: it serves no snapshot now."""
        self.shape, self.serving = shape, None

    async def loop(self) -> None:
        """Take every queued request (the first waits GATHER_S for the rest of its burst) and run
        those of one sampler's weights and the same sampling parameters as one generate call."""
        while True:
            jobs = [await self.queue.get()]
            await asyncio.sleep(GATHER_S)
            while not self.queue.empty():
                jobs.append(self.queue.get_nowait())
            groups: dict[tuple[str, str], list[SampleJob]] = {}
            for job in jobs:
                groups.setdefault((job.sampler.weights, repr(job.params)), []).append(job)
            for (weights, _), group in groups.items():
                await self._run(weights, group)

    async def _run(self, weights: str, jobs: list[SampleJob]) -> None:
        try:
            await self._serve(weights)
            asks = [(j.prompt, j.n, j.max_tokens, j.seed) for j in jobs]
            outs = await self.call("rollout", "sample", asks, jobs[0].params)
            for job, sequences in zip(jobs, outs, strict=True):
                logprobs = None
                if job.prompt_logprobs:
                    logprobs = await self.call("rollout", "prompt_logprobs", job.prompt)
                ids = [f"{job.request_id}:{i}" for i in range(len(sequences))]
                if job.record:  # before the answer: a training request may name them at once
                    self._record(job, ids, sequences)
                if not job.future.done():
                    job.future.set_result(sample_response(sequences, logprobs, ids))
        except Exception as e:  # every request of the call gets the error; the loop goes on
            failure = failure_of(e)
            for job in jobs:
                fail(job.future, failure)

    async def _serve(self, weights: str) -> None:
        """The engine holds the snapshot `weights` (given it unless it holds it already)."""
        if weights not in self.snapshots:
            raise NotFound(
                f"The sampler weights {weights!r} are gone: deleted, or past their ttl_seconds. Save "
                "them again (save_weights_for_sampler) and sample those."
            )
        if self.serving == weights:
            return
        if self.snapshots.shapes[weights] != self.shape:
            raise TandemError(
                f"The weights of {weights!r} were saved for another adapter shape than the one the "
                "service trains now (a later create_lora_training_client asked for another rank or "
                "targets): save them again from a model of the current shape, or restart the service."
            )
        self.serving = None  # while it changes: a failure leaves it unknown
        await self.call("rollout", "serve_weights", self.snapshots.get(weights))
        self.serving = weights

    def _record(self, job: SampleJob, ids: list[str], sequences: list) -> None:
        """Keep each sampled sequence for the training requests of the sampler's session to name."""
        for sequence_id, s in zip(ids, sequences, strict=True):
            sent = [float(x) for x in np.float32(s.logprobs)]  # as the answer carries them
            self.records.add(job.sampler.session_id, sequence_id, Recorded(job.prompt, s.tokens, sent))
