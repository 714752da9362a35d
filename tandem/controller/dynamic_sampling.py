"""DAPO's dynamic sampling (`algo.filter_groups`): groups that carry no learning signal are dropped
after scoring, and new prompts take their places, so every batch is full of informative groups.

A group whose n rewards are all equal has std_g = 0: every group-relative advantage is 0 and it
adds nothing to the gradient but dilutes the batch. Dropping it frees its place in the buffer
(`RolloutBuffer.drop`), so the controller admits another prompt in its place. A train step may draw
at most `max_filter_rounds` batches of prompts: past (max_filter_rounds - 1) x batch_size dropped
groups since the last step, the run stops with an error instead of generating forever on data the
policy always (or never) solves.
"""

from tandem.buffer import RolloutBuffer
from tandem.errors import TandemError
from tandem.sample import Sample


def uninformative_groups(samples: list[Sample]) -> set[int]:
    """Ids of the groups among `samples` whose rewards are all equal (std_g = 0, so A_i = 0 for
    every sample under any group-relative estimator). The reward compared is the final one, after
    any shaping (verl's `seq_final_reward`)."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.group_id, set()).add(s.reward)
    return {gid for gid, values in rewards.items() if len(values) == 1}


class DynamicSampling:
    """The controller's filter: drops groups from the buffer and counts what it dropped and refilled."""

    def __init__(self, batch_size: int, max_rounds: int):
        self.batch_size, self.max_rounds = batch_size, max_rounds
        self.owed = 0  # dropped groups whose replacement prompts have not started yet
        self.since_step = 0  # groups dropped since the last train step

    def keep(self, samples: list[Sample], buffer: RolloutBuffer, version: int) -> tuple[list[Sample], int]:
        """The samples of the informative groups, and how many groups were dropped. TandemError once
        the train step at `version` has drawn more than max_rounds batches of prompts."""
        dropped = uninformative_groups(samples)
        for gid in sorted(dropped):
            buffer.drop(gid)
        self.owed += len(dropped)
        self.since_step += len(dropped)
        allowed = (self.max_rounds - 1) * self.batch_size
        if self.since_step > allowed:
            raise TandemError(
                f"algo.filter_groups dropped {self.since_step} groups whose rewards were all equal "
                f"while filling the batch of step {version + 1} (batch_size={self.batch_size}); "
                f"algo.max_filter_rounds={self.max_rounds} allows {allowed}. The prompts are all "
                "solved or all failed by the policy: check the reward function and the data, raise "
                "rollout.n or rollout.temperature, or raise algo.max_filter_rounds."
            )
        return [s for s in samples if s.group_id not in dropped], len(dropped)

    def refilled(self, started: int) -> int:
        """`started` new groups were admitted -> how many of them replace dropped ones."""
        extra = min(self.owed, started)
        self.owed -= extra
        return extra

    def state_dict(self) -> dict[str, int]:
        return {"owed": self.owed, "since_step": self.since_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.owed, self.since_step = state["owed"], state["since_step"]
