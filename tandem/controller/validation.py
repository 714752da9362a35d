"""Validation as a state of the pipeline: held-out prompts run on the rollout workers once a version
is published (ahead of training prompts), are scored apart, and never mix into training data.

A version is due when the loop asks for it; its prompts start once every rollout worker holds it,
split into one chunk per worker; the chunks' samples are scored together when the last returns.
"""

from collections.abc import Callable

from tandem.controller.stats import val_stats
from tandem.rollout.group import make_groups
from tandem.sample import Prompt, Sample, episodes


class Validation:
    def __init__(
        self,
        prompts: list[Prompt],
        prompt_ids: list[list[int]],
        workers: int,
        seeded: Callable[[list[Sample]], list[Sample]],
    ):
        self.prompts, self.prompt_ids, self.workers, self.seeded = prompts, prompt_ids, workers, seeded
        self.due: list[int] = []  # versions to validate once published
        self.samples: dict[int, list[Sample]] = {}  # by version: the chunks returned so far
        self.left: dict[int, int] = {}  # by version: chunks still generating
        self.metrics: dict[int, dict[str, float]] = {}  # by the version validated

    def request(self, version: int) -> None:
        if self.prompts:
            self.due.append(version)

    def ready(self, published: int) -> list[tuple[int, list[list[Sample]]]]:
        """The due versions now published, each with its prompts in one chunk per worker; oldest first."""
        started = [v for v in self.due if v <= published]
        for v in started:
            self.due.remove(v)
        return [(v, self._start(v)) for v in started]

    def _start(self, version: int) -> list[list[Sample]]:
        # Negative group ids: held-out samples can never be taken for training groups.
        first = -len(self.prompt_ids)
        samples = self.seeded(make_groups(self.prompts, self.prompt_ids, n=1, first_group=first))
        per = -(-len(samples) // self.workers)
        chunks = [samples[i : i + per] for i in range(0, len(samples), per)]
        self.samples[version], self.left[version] = [], len(chunks)
        return chunks

    def returned(self, version: int, samples: list[Sample]) -> list[Sample] | None:
        """One chunk is back -> the version's samples once all are, else None."""
        self.samples[version].extend(episodes(samples))  # one held-out answer per prompt
        self.left[version] -= 1
        if self.left[version]:
            return None
        del self.left[version]
        return self.samples.pop(version)

    def scored(self, version: int, samples: list[Sample], reward: dict[str, float]) -> dict[str, float]:
        """The version's val/* metrics, from its scored samples and the reward call's counters."""
        versions = [v for s in samples for v in s.versions]
        self.metrics[version] = val_stats(samples, reward, float(min(versions) if versions else version))
        return self.metrics[version]
