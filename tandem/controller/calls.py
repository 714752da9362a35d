"""Every call the driver makes: its kind, the role that runs it and the worker method it names
(`ROUTES`, the one place a method name is written), and what a call in flight was for (`Call`)."""

from dataclasses import dataclass, field
from enum import Enum

from tandem.sample import Sample


class Kind(str, Enum):
    """The kinds of call. The first twelve are the loop's, each with a handler (`Loop.handlers`);
    the last four are checkpoint calls the driver waits on at a step boundary."""

    GENERATE = "generate"  # training prompts on a rollout worker
    VAL = "val"  # held-out prompts on a rollout worker
    REWARD = "reward"  # training samples' rewards
    VAL_REWARD = "val_reward"  # held-out samples' rewards (no shaping)
    REF = "ref"  # reference logprobs
    TEACHER = "teacher"  # the distillation teacher's logprobs
    SLEEP = "sleep"  # a rollout engine frees its memory for the train step
    VALUES = "values"  # a critic rank's values and advantages
    TRAIN = "train"  # a train (or critic) rank's step
    SEND = "send"  # a train rank's part of a weight push
    RECEIVE = "receive"  # a rollout worker stages a push
    RESYNC = "resync"  # a restarted rollout worker gets the newest weights
    SAVE = "save"  # a train (or critic) rank writes its part of a checkpoint
    LOAD = "load"  # a train (or critic) rank loads its part of one
    RNG_STATE = "rng_state"  # a rollout engine's sampling stream, for a checkpoint
    SET_RNG_STATE = "set_rng_state"  # ... and back, on resume


@dataclass(frozen=True)
class Route:
    # The roles whose workers run this kind of call (a call one worker answers: the first role the
    # run has, `Route.worker`).
    roles: tuple[str, ...]
    method: str  # the worker method it calls (`tandem.runtime.actors`, `tandem.sim.workers`)

    def worker(self, names: dict[str, list[str]]) -> str | None:
        """Rank 0 of the first of `roles` that has workers in the run (`names`: role -> workers)."""
        return next((names[r][0] for r in self.roles if names.get(r)), None)


ROUTES: dict[Kind, Route] = {
    Kind.GENERATE: Route(("rollout",), "generate"),
    Kind.VAL: Route(("rollout",), "generate"),
    Kind.REWARD: Route(("judge", "reward"), "score"),  # the judge where the run has one
    Kind.VAL_REWARD: Route(("reward",), "score"),
    Kind.REF: Route(("ref",), "score"),
    Kind.TEACHER: Route(("teacher",), "score"),
    Kind.SLEEP: Route(("rollout",), "sleep"),
    Kind.VALUES: Route(("critic",), "estimate"),
    Kind.TRAIN: Route(("train", "critic"), "train_step"),
    Kind.SEND: Route(("train",), "send_weights"),
    Kind.RECEIVE: Route(("rollout",), "receive_weights"),
    Kind.RESYNC: Route(("rollout",), "receive_weights"),
    Kind.SAVE: Route(("train", "critic"), "save"),
    Kind.LOAD: Route(("train", "critic"), "load"),
    Kind.RNG_STATE: Route(("rollout",), "rng_state"),
    Kind.SET_RNG_STATE: Route(("rollout",), "set_rng_state"),
}

GENERATING = (Kind.GENERATE, Kind.VAL)  # the calls that hold a rollout worker's slot
SCORERS = (Kind.REF, Kind.TEACHER)  # per-token scores a rewarded group gets, in this order


@dataclass
class Call:
    """A call in flight, and what it was for."""

    kind: Kind
    worker: str  # "<role>/<rank>"
    samples: list[Sample] = field(default_factory=list)
    version: int = -1  # the policy version it generates under, trains, or pushes
    rank: int = 0  # the worker's index within its role

    @property
    def method(self) -> str:
        return ROUTES[self.kind].method

    def __str__(self) -> str:
        return f"{self.kind.value} on {self.worker} (version {self.version})"
