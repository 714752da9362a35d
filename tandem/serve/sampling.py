"""The service's samplers and its sample requests, with no HTTP in it.

A sampler names the weights it samples: a snapshot saved by `save_weights_for_sampler` (any model,
any version: `tandem.serve.snapshots`), or the base. Sample requests queue apart from training
requests and run batched: the ones that arrive together (within `GATHER_S` of the first) and share
sampling parameters run as ONE generate call, whatever their samplers (several clients' adapters,
one client's versions, the base). The engine holds the base's weights, untouched, and a table of
the call's samplers' adapters (`ServeRollout.serve_adapters`, at most `TABLE` a call: a burst that
names more runs in calls of `TABLE`); each request's rows take its sampler's adapter unmerged,
x W0ᵀ + s · (x Aᵀ) Bᵀ (`tandem.model.row_adapters`), the base's rows none. With
`run.deterministic=true` the service's trainer computes that same unmerged form
(`tandem.model.lora.set_lora_form`), so each sampled token's logprob equals its own trainer's bit
for bit in a call of any mix; every call then runs that way, one sampler's too.

Where the engine cannot mix rows (`tandem.serve.workers.mixes_rows`: a full-weights service, an
adapter with `modules_to_save` (an untied lm_head trained whole replaces the base's head, which no
row can keep), an FP8 or paged or vLLM engine), and outside the deterministic mode for a call of
one sampler's requests, each sampler's requests run as one call, one after another, the engine
given that sampler's weights merged before it (`ServeRollout.serve_weights`, skipped when it holds
them already).
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
from tandem.serve.snapshots import RESIDENT, Snapshots
from tandem.serve.wire import sample_response

GATHER_S = 0.01  # how long the first sample request of a burst waits for the rest
TABLE = RESIDENT  # adapters in one call's table: as many snapshots as stay in memory


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
    def __init__(self, call: Callable[..., Awaitable], snapshots: Snapshots, records: Records, exact: bool):
        """call: the service's `(role, method, *args)` worker call, awaited; exact: run.deterministic
        (every call over the adapters' table, where the engine mixes rows)."""
        self.call, self.snapshots, self.records, self.exact = call, snapshots, records, exact
        self.samplers: dict[str, Sampler] = {}
        self.serving: str | tuple[str, ...] | None = None  # the snapshot merged, or the table's names
        self.shape = 0  # the trainer shape the engine is built for (the service's reset count)
        self.mixes = False  # whether the engine runs rows of several adapters in one call
        self.queue: asyncio.Queue[SampleJob] = asyncio.Queue()

    def add(self, sampler: Sampler) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = sampler
        return sampler_id

    def get(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise NotFound(f"No sampler {sampler_id!r}.")
        return self.samplers[sampler_id]

    def reshaped(self, shape: int, mixes: bool) -> None:
        """The engine was rebuilt for trainer shape `shape`: it serves no snapshot now; `mixes`:
        whether it runs rows of several adapters in one call (`ServeRollout.reset`)."""
        self.shape, self.serving, self.mixes = shape, None, mixes

    async def loop(self) -> None:
        """Take every queued request (the first waits GATHER_S for the rest of its burst) and run
        those of the same sampling parameters together (the module docstring)."""
        while True:
            jobs = [await self.queue.get()]
            await asyncio.sleep(GATHER_S)
            while not self.queue.empty():
                jobs.append(self.queue.get_nowait())
            groups: dict[str, list[SampleJob]] = {}
            for job in jobs:
                groups.setdefault(repr(job.params), []).append(job)
            for group in groups.values():
                await self._run_params(group)

    async def _run_params(self, jobs: list[SampleJob]) -> None:
        """One set of sampling parameters' requests: as one call over the table of their samplers'
        adapters (TABLE a call), or one call per sampler's weights merged."""
        by_weights: dict[str, list[SampleJob]] = {}
        for job in jobs:
            try:
                self._check(job.sampler.weights)
            except Exception as e:  # a gone or misshaped sampler fails its own requests alone
                fail(job.future, failure_of(e))
                continue
            by_weights.setdefault(job.sampler.weights, []).append(job)
        if not self.mixes or (len(by_weights) < 2 and not self.exact):
            for weights, group in by_weights.items():
                await self._run(group, lambda w=weights: self._serve(w), table=False)
            return
        names = [w for w in by_weights if not w.startswith("base:")]
        parts = [names[i : i + TABLE] for i in range(0, len(names), TABLE)] or [[]]
        for i, part in enumerate(parts):  # the base's rows ride with the first part
            chosen = [*part, *(w for w in by_weights if w.startswith("base:") and i == 0)]
            group = [job for w in chosen for job in by_weights[w]]
            await self._run(group, lambda p=tuple(part): self._serve_table(p), table=True)

    async def _run(self, jobs: list[SampleJob], serve: Callable[[], Awaitable], table: bool) -> None:
        """One generate call of `jobs` once `serve()` has given the engine their weights; `table`:
        each request's rows name their sampler's adapter (the base's none)."""
        try:
            await serve()
            adapters = [self._adapter(j) if table else None for j in jobs]
            asks = [(j.prompt, j.n, j.max_tokens, j.seed, a) for j, a in zip(jobs, adapters, strict=True)]
            outs = await self.call("rollout", "sample", asks, jobs[0].params)
            for job, adapter, sequences in zip(jobs, adapters, outs, strict=True):
                logprobs = None
                if job.prompt_logprobs:
                    logprobs = await self.call("rollout", "prompt_logprobs", job.prompt, adapter)
                ids = [f"{job.request_id}:{i}" for i in range(len(sequences))]
                if job.record:  # before the answer: a training request may name them at once
                    self._record(job, ids, sequences)
                if not job.future.done():
                    job.future.set_result(sample_response(sequences, logprobs, ids))
        except Exception as e:  # every request of the call gets the error; the loop goes on
            failure = failure_of(e)
            for job in jobs:
                fail(job.future, failure)

    @staticmethod
    def _adapter(job: SampleJob) -> str | None:
        weights = job.sampler.weights
        return None if weights.startswith("base:") else weights

    def _check(self, weights: str) -> None:
        """NotFound for weights gone, TandemError for weights of another adapter shape."""
        if weights not in self.snapshots:
            raise NotFound(
                f"The sampler weights {weights!r} are gone: deleted, or past their ttl_seconds. Save "
                "them again (save_weights_for_sampler) and sample those."
            )
        if self.snapshots.shapes[weights] != self.shape:
            raise TandemError(
                f"The weights of {weights!r} were saved for another adapter shape than the one the "
                "service trains now (a later create_lora_training_client asked for another rank or "
                "targets): save them again from a model of the current shape, or restart the service."
            )

    async def _serve(self, weights: str) -> None:
        """The engine holds the snapshot `weights` merged (given it unless it holds it already)."""
        if self.serving == weights:
            return
        self.serving = None  # while it changes: a failure leaves it unknown
        await self.call("rollout", "serve_weights", self.snapshots.get(weights))
        self.serving = weights

    async def _serve_table(self, names: tuple[str, ...]) -> None:
        """The engine holds the base's weights and a table of the snapshots `names`."""
        if self.serving == names:
            return
        self.serving = None
        await self.call("rollout", "serve_adapters", {n: self.snapshots.get(n) for n in names})
        self.serving = names

    def _record(self, job: SampleJob, ids: list[str], sequences: list) -> None:
        """Keep each sampled sequence for the training requests of the sampler's session to name."""
        for sequence_id, s in zip(ids, sequences, strict=True):
            sent = [float(x) for x in np.float32(s.logprobs)]  # as the answer carries them
            self.records.add(job.sampler.session_id, sequence_id, Recorded(job.prompt, s.tokens, sent))
