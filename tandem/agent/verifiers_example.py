"""A verifiers environment on the default task's rows, for `rollout.agent=verifiers:...`.

    tandem train rollout.agent=verifiers:tandem.agent.verifiers_example:load_environment

Two-digit addition (`tandem.data.tasks`' `addition`: "61+71=", ground truth "132"), played in two
turns: the model answers, the environment asks the same question again, the model answers again.
Its rubric scores each answer exactly (the reply, stripped, is the sum): `first_answer` and
`final_answer`, weight 0.5 each, so an episode's reward is 0, 0.5 or 1. It is an ordinary
verifiers v1 environment: a `Taskset` of `Task`s whose `@vf.reward` methods are the rubric, and an
`Env` whose `run` is the multi-turn protocol (`agent.interaction`: the caller is the user).

Its taskset loads `size` rows of `addition` drawn with `seed` from `split`, exactly the rows
tandem's own data has for the same arguments (`data.train_size`, `run.seed`); in a tandem run the
rows come from `data.*` and each is handed to the environment as its task (docs/agents.md).

verifiers finds a taskset by the name of a top-level module exporting it (`tandem-addition`
imports `tandem_addition`); this module registers itself under that name when imported.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import verifiers.v1 as vf

from tandem.agent.verifiers_harness import HARNESS_ID
from tandem.data.tasks import TASKS

TASKSET_ID = "tandem-addition"
MAX_TOKENS = 8  # per answer, as the default run's rollout.max_new_tokens


class AdditionData(vf.TaskData):
    ground_truth: str  # the sum, as text


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward(weight=0.5)
    async def first_answer(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return float(bool(replies) and (replies[0].content or "").strip() == self.data.ground_truth)

    @vf.reward(weight=0.5)
    async def final_answer(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages) == 2 and trace.last_reply == self.data.ground_truth)


class AdditionConfig(vf.TasksetConfig):
    size: int = 1000
    seed: int = 0
    split: Literal["train", "test"] = "train"


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        c = self.config
        rows = TASKS.get("addition")().make_rows(c.size, c.seed, c.split)
        return [AdditionTask(AdditionData(**as_task_data(row)), c.task) for row in rows]


class AskTwiceEnv(vf.SingleAgentEnv):
    """The model answers; the environment asks the same question again; the model answers again."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as interaction:
            if not (await interaction.turn()).terminated:  # the task's prompt opens the exchange
                await interaction.turn(task.data.prompt_text)


def as_task_data(row: dict[str, Any]) -> dict[str, Any]:
    """A row of `make_rows` (verl's columns) -> the task's data."""
    return {"prompt": row["prompt"], "ground_truth": str(row["reward_model"]["ground_truth"])}


def load_environment(**taskset: Any) -> vf.Env:
    """The environment: its agent on tandem's in-process chat harness, in the subprocess runtime
    (which only makes a scratch folder per rollout), at most MAX_TOKENS tokens per answer;
    `taskset`: AdditionConfig's fields (`task` plugs rewards, metrics, stops: verifiers' TaskConfig)."""
    config = vf.resolve_env_config(
        {
            "taskset": {"id": TASKSET_ID, **taskset},
            "agent": {
                "harness": {"id": HARNESS_ID},
                "runtime": {"type": "subprocess"},
                "sampling": {"max_tokens": MAX_TOKENS},
            },
        }
    )
    return vf.load_environment(config)


__all__ = ["AdditionTaskset", "AskTwiceEnv"]

sys.modules.setdefault(TASKSET_ID.replace("-", "_"), sys.modules[__name__])
