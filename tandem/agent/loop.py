"""Agent loops: what a rollout worker runs above its engine for every generate call (as verl's
agent_loop sits above its rollout server). `rollout.agent` picks one from `AGENTS`, or names a
user class as `pkg.module:Class`.

- `single_turn`: one engine call, today's behaviour exactly.
- `tools`: generate until a tool call or the end; run the tool; append its output as context tokens
  (loss mask 0); generate again after it, on the same token ids; until the end or a limit.

An episode's state lives in its `Sample` only — its tokens, loss mask and `agent_stats` — never in
the agent, so an episode stopped mid-way (a partial rollout, an abort) goes on correctly when it is
re-submitted later, to any worker. docs/agents.md has the whole story.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from tandem.agent.tools import TOOLS, Tool, ToolError
from tandem.errors import TandemError
from tandem.registry import Registry
from tandem.sample import Prompt, Sample, Status

if TYPE_CHECKING:  # the rollout package imports the engines: not needed to check a config
    from tandem.sample import SamplingParams

# One engine call, `RolloutWorker`'s: extends the samples' responses as `RolloutEngine.generate`
# does (stop strings included) and returns the same list.
Turn = Callable[[list[Sample], "SamplingParams"], list[Sample]]

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"  # around every tool output the model sees
TOOL_THREADS = 8  # tool calls of one turn run side by side (the python tool waits on a subprocess)


class AgentLoop:
    """The contract of an agent loop; subclass it (or write a class with the same methods).

    A rollout worker builds its agent once, as `cls(tokenizer=..., tools=[names], max_turns=n)`
    (`rollout.tools`, `rollout.max_turns`; an agent may ignore them), and calls `run` for every
    generate call, validation included.

    `run(turn, samples, params)` drives every sample's episode to its end and returns the list.
    `turn(samples, params)` is one engine call: it extends each response after what it already
    holds (a fresh sample starts, a partial one continues; the engine keeps the ids, never
    re-tokenizes them) and may be called any number of times with any subset of the samples and
    other params. `run` must:
    - return once every sample is FINISHED or ABORTED; a sample a turn returns ABORTED is returned
      as it is (the caller re-submits it, maybe to another worker, and `run` sees it again);
    - keep all the state an episode needs in the sample: its tokens, its loss mask, its
      `agent_stats`; a re-submitted sample may stop anywhere, even right after a tool call that
      has not run yet;
    - add tokens the policy did not sample (a tool's output) only with `Sample.extend_context`
      (loss mask 0, logprob 0.0);
    - count what it did per episode in `sample.agent_stats` (name -> number): each name becomes the
      step's `agent/<name>/mean` metric (and `val/agent/<name>/mean` on held-out prompts).
    - (optional) return, after the samples it was given, extra FINISHED samples of an episode
      (`Sample.episode_of` = the index of the episode's sample, in its group, with an index of their
      own past rollout.n): trained as rows of their own with the episode's reward and advantage
      (the openai agent's completions that do not extend each other).
    The worker decodes `response_text` from the whole response after `run`.

    `demonstration(text)` is how a transcript of this agent turns into response tokens and a loss
    mask, for `tandem sft`: the parts RL would not train on are masked the same way here; and
    `prompt_ids(prompt, ids)` the prompt those tokens follow (an openai agent's has its tools).
    """

    def __init__(self, tokenizer=None, tools: Sequence[str] = (), max_turns: int = 1):
        self.tokenizer = tokenizer

    def run(self, turn: Turn, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        raise NotImplementedError

    def demonstration(self, text: str) -> tuple[list[int], list[int]]:
        """Response text (no EOS) -> (token ids, loss mask): every token trained on."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, [1] * len(ids)

    def prompt_ids(self, prompt: Prompt, ids: list[int]) -> list[int]:
        """The ids an episode of this agent starts from, given the data's (`tandem sft` trains
        after them): the data's own."""
        return ids


AGENTS: Registry[Callable[..., AgentLoop]] = Registry("agent")


@AGENTS.register("single_turn")
class SingleTurn(AgentLoop):
    """One engine call per generate call: a response is one turn, as without agents."""

    def run(self, turn: Turn, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        return turn(samples, params)


@AGENTS.register("tools")
class ToolAgent(AgentLoop):
    """Multi-turn tool use: `<calc>37*48</calc>` is answered by `<result>1776</result>`.

    Each turn generates with the closing tags of `tools` as extra stop strings (kept in the
    response). A sample whose turn ended on a closing tag has made a call: the input is the text
    between the last opening tag and it; the tool's output (or `error: <why>`, for a call it
    refuses) is wrapped in `<result>...</result>`, tokenized on its own and appended with loss
    mask 0 — the earlier tokens are never re-tokenized — and the sample generates again. Which
    turn an episode is in comes from the sample: its current turn is the tokens after its last
    context token, so a call that was generated but not yet run (the episode stopped right after
    it) is run first when the sample comes back.

    Limits end the episode FINISHED with finish_reason "length" and `agent_stats["truncated"]`=1:
    a call beyond `max_turns` calls (it is not run), and the response cap (the call's and the
    sample's `max_new_tokens`), which counts every response token, generated or tool output: a
    tool output that would leave no room for one more generated token is not appended.

    agent_stats per episode: turns (generation turns), tool_calls (calls run), tool_errors (calls
    the tool refused or that failed), tool_use (1 when at least one call succeeded), truncated.
    """

    def __init__(self, tokenizer=None, tools: Sequence[str] = ("calculator",), max_turns: int = 4):
        super().__init__(tokenizer)
        if not tools:
            raise TandemError("Agent 'tools' needs at least one tool (rollout.tools).")
        self.tools: dict[str, Tool] = {t.closer: t for t in map(TOOLS.get, tools)}
        self.max_turns = max_turns
        self._pool: ThreadPoolExecutor | None = None

    def run(self, turn: Turn, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        params = replace(params, stop=[*params.stop, *self.tools])  # a call ends a turn
        for s in samples:
            for key in ("turns", "tool_calls", "tool_errors", "tool_use", "truncated"):
                s.agent_stats.setdefault(key, 1.0 if key == "turns" else 0.0)
        todo = list(samples)
        while todo:
            self._answer(todo, params)  # calls still to run, from the last turn or the last call
            live = [s for s in todo if s.status is not Status.FINISHED]
            if not live:
                break
            turn(live, params)
            for s in live:
                if s.status is Status.FINISHED:
                    s.agent_stats["truncated"] = float(s.finish_reason == "length")
            todo = [s for s in live if s.status is Status.FINISHED and self._call(s) is not None]
        return samples

    def _answer(self, samples: list[Sample], params: SamplingParams) -> None:
        """Run the pending call of every sample that has one; the episode goes on (RUNNING) after
        its output, or ends at a limit."""
        calls = []
        for s in samples:
            if (call := self._call(s)) is None:
                continue
            if s.agent_stats["tool_calls"] >= self.max_turns:  # one call too many: not run
                self._truncate(s)
            else:
                calls.append((s, call))
        if self._pool is None and calls:
            self._pool = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tool")
        outputs = list(self._pool.map(_run_tool, [c for _, c in calls])) if calls else []
        for (s, _), (text, ok) in zip(calls, outputs, strict=True):
            stats = s.agent_stats
            stats["tool_calls"] += 1
            stats["tool_errors"] += float(not ok)
            stats["tool_use"] = max(stats["tool_use"], float(ok))
            ids = self.tokenizer.encode(RESULT_OPEN + text + RESULT_CLOSE, add_special_tokens=False)
            if len(s.response_ids) + len(ids) >= _cap(s, params):  # no room left to answer after it
                self._truncate(s)
                continue
            s.extend_context(ids)
            stats["turns"] += 1
            s.status, s.finish_reason = Status.RUNNING, None

    def _call(self, s: Sample) -> tuple[Tool, str | None] | None:
        """(tool, its input) when the sample's current turn ended on a call, else None; the input
        is None when the call has no opening tag."""
        text = self.tokenizer.decode(s.response_ids[context_end(s) :], skip_special_tokens=True)
        found = [(i, closer) for closer in self.tools if (i := text.find(closer)) >= 0]
        if not found:
            return None
        end, closer = min(found)
        tool = self.tools[closer]
        start = text.rfind(tool.opener, 0, end)
        return tool, (None if start < 0 else text[start + len(tool.opener) : end])

    @staticmethod
    def _truncate(s: Sample) -> None:
        s.end("length")
        s.agent_stats["truncated"] = 1.0

    def demonstration(self, text: str) -> tuple[list[int], list[int]]:
        """Each `<result>...</result>` span is tokenized on its own with loss mask 0, as `run`
        appends tool outputs; the text between spans is trained on."""
        ids: list[int] = []
        mask: list[int] = []
        rest = text
        while (start := rest.find(RESULT_OPEN)) >= 0 and (end := rest.find(RESULT_CLOSE, start)) >= 0:
            end += len(RESULT_CLOSE)
            for part, trained in ((rest[:start], 1), (rest[start:end], 0)):
                part_ids = self.tokenizer.encode(part, add_special_tokens=False) if part else []
                ids += part_ids
                mask += [trained] * len(part_ids)
            rest = rest[end:]
        tail = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
        return ids + tail, mask + [1] * len(tail)


def _run_tool(call: tuple[Tool, str | None]) -> tuple[str, bool]:
    """(output text, whether the call succeeded); a refused or failed call shows `error: <why>`."""
    tool, text = call
    try:
        if text is None:
            raise ToolError(f"no {tool.opener} before {tool.closer}")
        return tool(text), True
    except ToolError as e:
        return f"error: {e}", False


def context_end(s: Sample) -> int:
    """Index just past the response's last context token (loss mask 0); 0 when it has none: the
    current turn is the tokens after it."""
    return max((i + 1 for i, m in enumerate(s.loss_mask) if m == 0), default=0)


def _cap(s: Sample, params: SamplingParams) -> int:
    """The most response tokens the sample may have (`GenerateCall.cap`)."""
    return min(s.max_new_tokens or params.max_new_tokens, params.max_new_tokens)
