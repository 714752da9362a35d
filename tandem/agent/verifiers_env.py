"""`rollout.agent=verifiers:pkg.module:function`: a verifiers environment as the rollout agent.

`function()` returns a verifiers v1 environment (`vf.Env`: its taskset's tasks, their rubric — the
`@vf.reward` methods — and its `run`, the multi-turn protocol). Each rollout worker builds it once
and serves it (`Env.serving()`: its interception servers, shared tools, `start`); for every sample
of a generate call it plays ONE episode (`Env.run_episode`) of the task the sample's row names,
with the model at the worker's OpenAI-compatible endpoint (`openai_agent.py`): every model call of
the episode goes harness -> the environment's interception server -> the endpoint, so the tokens
of all calls become the training sample, as for any OpenAI agent. The episode's reward is the
trained trace's reward (the rubric's weighted sum); each reward function's score and each metric
come along as info numbers (`agent/reward/<name>/mean`, `agent/metric/<name>/mean`).

Which task a row is: the environment owns its tasks, tandem's loop owns the rows it draws
(`data.*`); as verifiers' own env server does, the worker rebuilds the task from its data
(`Task(TaskData, config)`): the data a row carries in `extra_info["verifiers"]` (rows written by
`rows`/`save_rows` from the environment's taskset), else the row itself read as the task's data
(its messages or text as `prompt`, every other column by name: an environment written for tandem's
rows, as `tandem.agent.verifiers_example` is).

The seats that play the policy (no model or endpoint of their own) must run tandem's harness,
`tandem-chat` (verifiers_harness.py: the chat loop in-process; verifiers' own harnesses are
programs set up with `uv` from the network). A failed episode — the harness, a hook or the rubric
raised, the environment's `run` failed — ends with reward 0 and is counted in agent/errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tandem.agent.openai_agent import OpenAIAgent
from tandem.agent.specs import named_attr
from tandem.errors import TandemError

if TYPE_CHECKING:
    import openai
    import verifiers.v1 as vf

PREFIX = "verifiers:"
DATA_KEY = "verifiers"  # extra_info[DATA_KEY]: the verifiers task data of a row
FORM = "rollout.agent=verifiers:pkg.module:function, with `function()` returning a verifiers v1 `Env`"


class EpisodeFailed(TandemError):
    """The environment's episode failed (its last error): the episode's reward is 0."""


def load_env_fn(spec: str) -> Callable[[], vf.Env]:
    """ "verifiers:pkg.module:function" (or without the prefix) -> the function building the env."""
    fn = named_attr(spec, PREFIX, FORM, before_import=_import_verifiers)
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        module_name, _, attr = spec.removeprefix(PREFIX).partition(":")
        what = "has no function" if fn is None else "has a coroutine function, not a plain one:"
        raise TandemError(f"Agent {spec!r}: module {module_name!r} {what} {attr!r}. Expected {FORM}.")
    return fn


def build_env(spec: str) -> vf.Env:
    """The environment `spec` names, checked: its policy seats run tandem's harness."""
    import verifiers.v1 as vf

    fn = load_env_fn(spec)
    try:
        env = fn()
    except Exception as e:  # the user's code or verifiers refused its config: a config error
        raise TandemError(f"Agent {spec!r}: {fn.__name__}() raised {type(e).__name__}: {e}") from None
    if not isinstance(env, vf.Env):
        raise TandemError(f"Agent {spec!r}: the function returned a {type(env).__name__}. Expected {FORM}.")
    from tandem.agent.verifiers_harness import HARNESS_ID

    for seat, harness in env.config.agent_harnesses().items():
        agent = getattr(env.config, seat)
        if agent.model is None and agent.client is None and harness.id != HARNESS_ID:
            raise TandemError(
                f"Agent {spec!r}: the environment's seat {seat!r} plays the policy with harness "
                f"{harness.id!r}; tandem serves the policy to its own in-process chat harness only: "
                f'give the seat {{"harness": {{"id": "{HARNESS_ID}"}}, "runtime": {{"type": "subprocess"}}}} '
                "(docs/agents.md, verifiers environments)."
            )
    return env


class VerifiersAgent(OpenAIAgent):
    """The OpenAI agent loop (endpoint, batching, token chains, faults) whose agent function plays
    one episode of `env` (`build_env`'s) per sample."""

    def __init__(
        self,
        tokenizer=None,
        tools: Sequence[str] = (),
        max_turns: int = 8,
        env: vf.Env | None = None,
        **openai,
    ):
        super().__init__(tokenizer, tools, max_turns, fn=self._play, **openai)
        if env is None:
            raise TandemError(f"VerifiersAgent needs an environment: {FORM}.")
        self.env = env
        # verifiers logs two INFO lines per rollout; the run's metrics count its episodes
        logging.getLogger("verifiers").setLevel(logging.WARNING)
        self._env_stack: contextlib.AsyncExitStack | None = None
        self._env_lock: asyncio.Lock | None = None

    async def _play(self, client: openai.AsyncOpenAI, task: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """One episode of the row's task, its model calls through `client`'s endpoint."""
        import verifiers.v1 as vf

        from tandem.agent.openai_server import EPISODE_HEADER
        from tandem.agent.verifiers_harness import EPISODE

        await self._start_env()
        EPISODE.set(client.default_headers[EPISODE_HEADER])  # this episode's task only
        # One endpoint config for all episodes: the interception server keeps one client per config.
        endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var="TANDEM_ENDPOINT_KEY")
        context = vf.ModelContext(model=self.model_name, client=endpoint)
        episode = await self.env.run_episode(task_of(self.env, task), context)
        return reward_of(episode)

    async def _start_env(self) -> None:
        """Enter `env.serving()` once, on the agents' event loop (its servers live there)."""
        if self._env_lock is None:
            self._env_lock = asyncio.Lock()
        async with self._env_lock:
            if self._env_stack is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._env_stack = stack

    def close(self) -> None:
        if self._env_stack is not None and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._env_stack.aclose(), self._loop).result(timeout=30)
            self._env_stack = None
        super().close()


def task_of(env: vf.Env, row: dict[str, Any]) -> vf.Task:
    """The environment's task for a tandem row (the task dict an OpenAI agent gets): its data is
    `extra_info["verifiers"]` when the row has it, else the row with `prompt` = its messages or
    text, as verifiers' env server rebuilds a dispatched task."""
    task_cls = type(env.taskset).task_type()
    data = (row.get("extra_info") or {}).get(DATA_KEY)
    if data is None:
        data = {**row, "prompt": row.get("messages") or row.get("text")}
    return task_cls(task_cls.data_type().model_validate(data), env.config.taskset.task)


def reward_of(episode: vf.Episode) -> tuple[float, dict[str, float]]:
    """(the trained trace's reward, {"reward/<name>": score, "metric/<name>": value}); EpisodeFailed
    with the last error when the episode or a trace of it failed."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces if not t.ok for e in t.errors)]
        last = errors[-1] if errors else None
        why = f"{last.type}: {last.message}" if last else "no error recorded"
        raise EpisodeFailed(f"the verifiers episode failed ({why})")
    trained = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if len(trained) != 1:
        raise EpisodeFailed(
            f"the verifiers episode has {len(trained)} trainable traces; tandem trains one sample per "
            "episode (mark the other seats untrainable in the environment's `setup`)"
        )
    (trace,) = trained
    info = {f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None}
    info |= {f"metric/{k}": v for k, v in trace.metrics.items() if v is not None}
    return trace.reward, info


def rows(env: vf.Env, n: int | None = None, seed: int | None = None) -> list[dict[str, Any]]:
    """The environment's tasks as tandem rows (verl's columns): the first `n` (all when None; of a
    view shuffled with `seed` when given), each carrying its task data in `extra_info["verifiers"]`
    (its `model_dump`, as verifiers dispatches a task) and its key in `extra_info["key"]`. Its prompt
    (the system prompt, then the task's prompt; a placeholder for a task its user opens) is
    tandem's view of the row (length checks, logs): the environment renders its own."""
    from verifiers.v1.dialects.chat import message_to_wire

    tasks = env.taskset if seed is None else env.taskset.shuffle(seed)
    if n is not None:
        tasks = tasks.take(n)
    out = []
    for task in tasks:
        d = task.data
        if isinstance(d.prompt, str):
            messages = [{"role": "user", "content": d.prompt}]
        elif d.prompt:
            messages = [message_to_wire(m) for m in d.prompt]
        else:
            messages = [{"role": "user", "content": f"(a task its environment opens: {task.key[:12]})"}]
        if d.system_prompt:
            messages.insert(0, {"role": "system", "content": d.system_prompt})
        extra = {DATA_KEY: d.model_dump(mode="json"), "key": task.key}
        out.append({"data_source": DATA_KEY, "prompt": messages, "extra_info": extra})
    return out


def save_rows(spec: str, out: str, n: int | None = None, seed: int | None = None) -> str:
    """Write `rows` of the environment `spec` names to `out` (.jsonl / .json / .parquet)."""
    from tandem.data.dataset import save_rows as save

    save(rows(build_env(spec), n, seed), out)
    return os.fspath(out)


def _import_verifiers() -> None:
    try:
        import verifiers.v1  # noqa: F401
    except ImportError:
        raise TandemError(
            "rollout.agent=verifiers:... runs a verifiers environment, and the verifiers package is not "
            "installed: pip install verifiers (tandem is tested with 0.4.0)."
        ) from None
