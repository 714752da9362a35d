"""What each call the loop has in flight is for: its kind, its worker, its samples and version."""

from dataclasses import dataclass, field
from enum import Enum

from tandem.sample import Sample


class Kind(str, Enum):
    """The kinds of call; the loop's handler for a kind is `on_<value>`."""

    GENERATE = "generate"  # training prompts on a rollout worker
    VAL = "val"  # held-out prompts on a rollout worker
    REWARD = "reward"  # training samples' rewards
    VAL_REWARD = "val_reward"  # held-out samples' rewards (no shaping)
    REF = "ref"  # reference logprobs
    SLEEP = "sleep"  # a rollout engine frees its memory for the train step
    VALUES = "values"  # a critic rank's values and advantages
    TRAIN = "train"  # a train (or critic) rank's step
    SEND = "send"  # a train rank's part of a weight push
    RECEIVE = "receive"  # a rollout worker stages a push
    RESYNC = "resync"  # a restarted rollout worker gets the newest weights


GENERATING = (Kind.GENERATE, Kind.VAL)  # the calls that hold a rollout worker's slot


@dataclass
class Call:
    """A call in flight, and what it was for."""

    kind: Kind
    worker: str  # "<role>/<rank>"
    samples: list[Sample] = field(default_factory=list)
    version: int = -1  # the policy version it generates under, trains, or pushes
    rank: int = 0  # the worker's index within its role

    def __str__(self) -> str:
        return f"{self.kind.value} on {self.worker} (version {self.version})"
