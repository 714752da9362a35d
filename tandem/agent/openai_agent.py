"""`rollout.agent=openai:pkg.module:function`: agents written against the OpenAI API.

The user's agent is an ordinary coroutine, `async def run(client: openai.AsyncOpenAI, task: dict)
-> float` (the episode's reward) or `-> (float, info)`. For every sample of a generate call the
rollout worker starts one episode: it calls the function with a client whose `base_url` is the
worker's own OpenAI-compatible endpoint (`openai_server.py`) and whose requests carry the episode's
id, and records every token the engine generated for it.

Batching: the episodes of a call run side by side on one asyncio loop (a thread of the worker),
the one the endpoint's server runs on; their requests queue here, and the worker's own thread
serves them as one engine call once every episode still running is waiting for the model (or the
oldest request has waited `BATCH_WAIT_S`, so an episode busy with a slow tool does not hold up the
others). So many concurrent episodes share one batch, on whichever engine the run uses.

What becomes training samples (docs/agents.md): a request whose messages are an earlier request's
messages, the assistant message the endpoint returned for it, then new messages EXTENDS that
completion: its prompt is the earlier prompt ids + the generated ids + the new messages' ids
(`ChatRenderer.continuation`: nothing is re-tokenized, and the engine's prefix cache serves the
shared prefix). A chain is a first prompt, then every completion that extends the one before (loss
mask 1, behaviour logprobs and versions from the engine) and everything between them (tool
results, user turns: loss mask 0). Every chain that no later request extended is one training
sample, all with the episode's reward: the chain of the last completion the agent received is the
episode's own sample (the group's), and each other one (an agent that rewrote its history, a
sub-agent's calls, choices of an n > 1 request it did not continue) an extra sample of the episode
(`Sample.episode_of`), counted in agent/samples.

Limits and faults end an episode with reward 0, counted in agent/* and logged once per kind: the
agent raised (errors), ran past `timeout_s` (timeouts), never called the model (no_calls). A
request past the episode's limits (`max_turns` calls; `max_new_tokens` response tokens in its
chain) or one the run cannot serve (a prompt longer than `max_prompt_length`, an unknown parameter)
is refused with HTTP 400 naming the reason (bad_requests, truncated): the agent decides what
happens next, and if it raises, the episode ends as above.

An episode cannot move between workers (its state is a Python coroutine): when the worker is
aborted (a partial rollout), the call's unfinished episodes are cancelled and their samples come
back ABORTED and empty, to start afresh when re-submitted. Under `rollout.on_update=abort` a
request cut short by a weight update is served again, continuing its tokens on the new weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tandem.agent.chat import ChatRenderer, parse_tool_calls, same_message
from tandem.agent.loop import AgentLoop, Turn
from tandem.agent.openai_request import EPISODE_HEADER, BadRequest, Choice, Request
from tandem.agent.specs import load_agent_fn
from tandem.agent.tools import TOOLS, openai_tool
from tandem.errors import TandemError
from tandem.sample import Prompt, Sample, Status

if TYPE_CHECKING:
    from tandem.agent.openai_server import EndpointServer
    from tandem.sample import SamplingParams

log = logging.getLogger(__name__)

BATCH_WAIT_S = 0.05  # a pause in arrivals this long ends a batch while served episodes are busy
FIRST_WAIT_S = 5.0  # the longest a request waits for episodes yet to make their first request
SCRATCH_INDEX = 1 << 20  # engine requests are numbered from here, apart from the samples' own keys
FAULTS = ("errors", "timeouts", "no_calls")
STATS = ("turns", "tool_calls", "tool_parse_errors", *FAULTS, "bad_requests", "truncated", "samples",
         "prompt_tokens", "reused_prompt_tokens")  # fmt: skip
EXTRA_INDEX = 1 << 16  # an episode's extra samples: index (i + 1) * EXTRA_INDEX + k for the group's sample i


@dataclass
class Chain:
    """Completions that extend each other: one training sample's tokens."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    def then(self, context: list[int], s: Sample) -> Chain:
        """This chain, the context ids, then the generated response of `s` (its own prompt is this
        chain's prompt + response + context)."""
        version = s.versions[0] if s.versions else (self.versions[-1] if self.versions else 0)
        return Chain(
            self.prompt_ids,
            self.response_ids + context + s.response_ids,
            self.logprobs + [0.0] * len(context) + s.logprobs,
            self.versions + [version] * len(context) + s.versions,
            self.loss_mask + [0] * len(context) + [1] * len(s.response_ids),
        )


@dataclass
class Served:
    """One choice the endpoint returned: what a later request may extend."""

    chain: Chain
    ids: list[int]
    text: str  # the completion's text (plain completions extend on it)
    message: dict | None  # chat: the assistant message returned
    ended_on_eos: bool
    finish: str  # the engine's finish reason: "stop" or "length"
    extended: bool = False  # a served request continued it: its chain is not a sample of its own


@dataclass
class Call:
    """A served request: its messages (chat) or prompt text, and its choices."""

    messages: list[dict] | None
    prompt_text: str | None
    prompt_ids: list[int]
    choices: list[Served]


@dataclass(eq=False)  # compared by identity: `in` over a call's episodes must not compare field by field
class Episode:
    id: str
    sample: Sample
    task: dict[str, Any]
    deadline: float
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATS, 0.0))
    calls: list[Call] = field(default_factory=list)
    last: Served | None = None  # the last choice the agent received (choice 0 of its last call)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    future: Any = None
    ended: bool = False  # finished, failed or cancelled: takes no more requests
    aborted: bool = False  # running when the worker was aborted: comes back ABORTED, whatever follows


@dataclass(eq=False)  # (as Episode)
class Pending:
    """A request waiting for the engine: one engine sample per choice."""

    request: Request
    episode: Episode
    prompt_ids: list[int]
    parent: Served | None  # the choice it extends, None for a fresh chain
    context: list[int]  # ids between the parent's completion and this generation
    samples: list[Sample]
    since: float
    answer: asyncio.Future  # on the endpoint's loop: (choices, prompt tokens), or the BadRequest


class OpenAIAgent(AgentLoop):
    """The agent loop behind `rollout.agent=openai:...` (the module docstring tells the whole story)."""

    def __init__(
        self,
        tokenizer=None,
        tools: Sequence[str] = (),
        max_turns: int = 8,
        fn: str | Callable = "",  # "openai:pkg.module:function", or the coroutine function itself
        timeout_s: float = 120.0,
        max_prompt_length: int = 1 << 30,
        tool_parser: str = "hermes",
        model_name: str = "tandem",
    ):
        super().__init__(tokenizer)
        self.fn = fn if callable(fn) else load_agent_fn(fn)
        self.tools = list(tools)  # for `tandem sft` only: the tools its demonstrations call
        self.max_turns, self.timeout_s, self.max_prompt_length = max_turns, timeout_s, max_prompt_length
        self.tool_parser, self.model_name = tool_parser, model_name
        self._renderer: ChatRenderer | None = None
        self._server: EndpointServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._episodes: dict[str, Episode] = {}
        self._pending: list[Pending] = []
        self._logged: set[str] = set()
        self._numbers = itertools.count(SCRATCH_INDEX)
        self._arrived = 0.0  # when the last request arrived

    # -- the worker's side: one generate call ------------------------------------------------------
    def run(self, turn: Turn, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        self._start()
        self._params = params
        episodes = []
        for s in samples:
            task = {
                "messages": s.prompt.messages,
                "text": s.prompt.text,
                "ground_truth": s.prompt.ground_truth,
                "data_source": s.prompt.data_source,
                "extra_info": s.prompt.extra_info,
                **s.prompt.columns,
            }
            ep = Episode(uuid.uuid4().hex, s, task, time.monotonic() + self.timeout_s)
            with self._cond:
                self._episodes[ep.id] = ep
            ep.future = asyncio.run_coroutine_threadsafe(self._episode(ep), self._loop)
            ep.future.add_done_callback(lambda _: self._wake())
            episodes.append(ep)
        aborted = False
        while True:
            batch = self._next_batch(episodes)
            if batch is None:
                break
            if not self._serve(turn, batch, params):
                aborted = True
                break
        extras = [x for ep in episodes for x in self._finish(ep, aborted)]
        with self._cond:
            for ep in episodes:
                self._episodes.pop(ep.id, None)
        return samples + extras

    def _next_batch(self, episodes: list[Episode]) -> list[Pending] | None:
        """The requests to serve now; None once every episode has ended. Serve when every episode
        still running waits for the model; else, when only episodes that were served before are
        busy (in a tool, say) and no request has arrived for BATCH_WAIT_S; an episode that has not
        made its first request yet is waited for up to FIRST_WAIT_S (a quarter of the episode's
        time limit, if that is less)."""
        with self._cond:
            while True:
                now = time.monotonic()
                for ep in episodes:  # a hung agent: give up on it (its coroutine is cancelled)
                    if not ep.ended and now > ep.deadline + 1.0:
                        self._fail(ep, "timeouts", f"ran past rollout.agent_timeout_s={self.timeout_s:g} s")
                live = [ep for ep in episodes if not ep.ended and not ep.future.done()]
                mine = [p for p in self._pending if p.episode in episodes]
                waiting = {p.episode.id for p in mine}
                idle = [ep for ep in live if ep.id not in waiting]
                starting = any(not ep.calls for ep in idle)
                if mine and (
                    not idle
                    or (not starting and now - self._arrived >= BATCH_WAIT_S)
                    or now - min(p.since for p in mine) >= min(FIRST_WAIT_S, self.timeout_s / 4)
                ):
                    self._pending = [p for p in self._pending if p not in mine]
                    return mine
                if not live and not mine:
                    return None
                self._cond.wait(BATCH_WAIT_S / 2)

    def _serve(self, turn: Turn, batch: list[Pending], params: SamplingParams) -> bool:
        """One engine call per distinct stop list; False when the worker was aborted."""
        by_stop: dict[tuple[str, ...], list[Pending]] = {}
        for p in batch:
            by_stop.setdefault(tuple(p.request.stop), []).append(p)
        retry = []
        for stop, group in by_stop.items():
            call_params = replace(params, stop=[*params.stop, *stop], include_stop_str_in_output=False)
            engine_samples = [s for p in group for s in p.samples]
            before = [len(s.response_ids) for s in engine_samples]
            turn(engine_samples, call_params)
            if all(
                s.status is Status.ABORTED and len(s.response_ids) == n
                for s, n in zip(engine_samples, before, strict=True)
            ):
                with self._cond:  # before the agents hear of it (and may fail on it)
                    for ep in {id(p.episode): p.episode for p in batch}.values():
                        ep.aborted = not ep.ended
                for p in batch:  # the worker was aborted: no request of this call is served
                    self._reply(
                        p, BadRequest("the rollout worker was aborted (a partial rollout)", status=503)
                    )
                return False
            for p in group:
                if any(s.status is Status.ABORTED for s in p.samples):  # cut by a weight update
                    for s in p.samples:
                        s.status = Status.RUNNING
                    retry.append(p)
                else:
                    self._answer(p, call_params)
        if retry:
            with self._cond:
                self._pending.extend(retry)
        return True

    def _answer(self, p: Pending, params: SamplingParams) -> None:
        """Turn the engine's samples into choices, record them in the episode, release the request."""
        r, ep = p.request, p.episode
        eos = getattr(self.tokenizer, "eos_token_id", None)
        choices, served = [], []
        for s in p.samples:
            text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            cut = _cut(text, r.stop)
            finish = "length" if s.finish_reason == "length" else "stop"
            content, calls = cut, []
            if r.chat and r.tools:
                parsed = parse_tool_calls(cut, self.tool_parser)
                if parsed.parse_error:
                    ep.stats["tool_parse_errors"] += 1
                    self._log_once(
                        "tool_parse_errors", f"a tool call could not be read: {parsed.parse_error}"
                    )
                content, calls = parsed.content, parsed.tool_calls
                ep.stats["tool_calls"] += len(calls)
                if calls and finish == "stop":
                    finish = "tool_calls"
            tokens = [self.tokenizer.decode([t]) for t in s.response_ids]
            choices.append(
                Choice(cut, list(s.response_ids), list(s.logprobs), tokens, finish, content, calls)
            )
            parent_chain = p.parent.chain if p.parent is not None else Chain(p.prompt_ids)
            chain = parent_chain.then(p.context, s)
            message = None
            if r.chat:
                message = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
            ended_on_eos = bool(s.response_ids) and s.response_ids[-1] == eos
            served.append(
                Served(chain, list(s.response_ids), cut, message, ended_on_eos, s.finish_reason or "stop")
            )
        with self._cond:
            if p.parent is not None:
                p.parent.extended = True
            ep.calls.append(
                Call(
                    r.messages if r.chat else None,
                    r.prompt if isinstance(r.prompt, str) else None,
                    p.prompt_ids,
                    served,
                )
            )
            ep.last = served[0]
            ep.stats["turns"] += 1
            ep.stats["prompt_tokens"] += len(p.prompt_ids)
            ep.stats["reused_prompt_tokens"] += len(p.prompt_ids) - len(p.context) if p.parent else 0
        self._reply(p, (choices, len(p.prompt_ids)))

    def _reply(self, p: Pending, answer: tuple[list[Choice], int] | BadRequest) -> None:
        """Hand the request its answer (or its refusal) on the endpoint's loop, where it waits."""
        self._loop.call_soon_threadsafe(_settle, p.answer, answer)

    def _finish(self, ep: Episode, aborted: bool) -> list[Sample]:
        """The episode's sample (its final chain, the agent's reward, its stats) -> its extra
        samples: the other chains no request extended, with the same reward."""
        s = ep.sample
        if not ep.future.done():
            ep.future.cancel()
        if aborted and (ep.aborted or not ep.ended):
            s.response_ids, s.logprobs, s.versions, s.loss_mask = [], [], [], []
            s.end("abort")
            return []
        ep.ended = True
        if not ep.calls and not any(ep.stats[f] for f in FAULTS):
            self._fail(ep, "no_calls", "returned without calling the model")
        reward = ep.reward if not any(ep.stats[f] for f in FAULTS) else 0.0
        extras = []
        for served in (c for call in ep.calls for c in call.choices):
            if served.extended or served is ep.last:
                continue
            extra = Sample(s.prompt, [], s.group_id, (s.index + 1) * EXTRA_INDEX + len(extras))
            _fill(extra, served.chain, reward, served.finish)
            extra.episode_of = s.index
            extras.append(extra)
        _fill(s, ep.last.chain if ep.last is not None else Chain(s.prompt_ids), reward, "stop")
        if ep.stats["truncated"]:
            s.finish_reason = "length"
        ep.stats["samples"] = 1.0 + len(extras)
        s.agent_stats.update(ep.stats)
        s.agent_stats.update({k: float(v) for k, v in ep.info.items() if isinstance(v, (int, float))})
        return extras

    # -- tandem sft: demonstrations as the endpoint's chains ---------------------------------------
    def prompt_ids(self, prompt: Prompt, ids: list[int]) -> list[int]:
        """A chat prompt rendered with the OpenAI schemas of `rollout.tools` (`openai_tool`), as an
        agent that offers them sends it."""
        if not self.tools or not prompt.messages:
            return ids
        return self._chat().prompt(prompt.messages, [openai_tool(n) for n in self.tools])

    def demonstration(self, text: str) -> tuple[list[int], list[int]]:
        """A transcript in the tools' tag format (`<calc>37*48</calc><result>1776</result>1776`) as
        the endpoint's chain holds such an episode: each call written as the template writes a tool
        call, then EOS (loss mask 1); the tool message and the next generation prompt as the
        template renders them after it (loss mask 0); the rest as text (loss mask 1). The template
        must render a conversation's prefix as a prefix of the whole (as the endpoint needs)."""
        chat, eos = self._chat(), self.tokenizer.eos_token_id
        tools = [openai_tool(n) for n in self.tools]
        names = {TOOLS.get(n).tag: n for n in self.tools}
        ids: list[int] = []
        mask: list[int] = []
        done = 0
        for m in _TAGGED_CALL.finditer(text):
            if m.group(1) not in names:
                continue
            name = names[m.group(1)]
            args = json.dumps({TOOLS.get(name).argument: m.group(2)})
            call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}
            said = text[done : m.start()]
            written = chat.encode(said + f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>')
            served = [
                {"role": "user", "content": ""},
                {"role": "assistant", "content": said, "tool_calls": [call]},
            ]
            result = [{"role": "tool", "tool_call_id": "call_0", "content": m.group(3)}]
            context = chat.continuation(served, result, tools, ended_on_eos=True) or []
            ids += written + [eos] + context
            mask += [1] * (len(written) + 1) + [0] * len(context)
            done = m.end()
        rest = chat.encode(text[done:])
        return ids + rest, mask + [1] * len(rest)

    # -- the endpoint's side: requests from the agents --------------------------------------------
    async def _request(self, r: Request) -> tuple[list[Choice], int]:
        """The endpoint's backend (on its loop): queue the request, await the engine's answer."""
        with self._cond:
            ep = self._episodes.get(r.episode)
            if ep is None or ep.ended:
                raise BadRequest(f"episode {r.episode!r} is not running on this worker", status=404)
            pending = self._prepare(ep, r)
            self._pending.append(pending)
            self._arrived = time.monotonic()
            self._cond.notify_all()
        try:
            return await asyncio.wait_for(pending.answer, max(ep.deadline - time.monotonic(), 0) + 5.0)
        except asyncio.TimeoutError:
            raise BadRequest("the episode ran past its time limit", status=408) from None

    def _prepare(self, ep: Episode, r: Request) -> Pending:
        """The request's prompt ids (extending an earlier completion where it can) and its engine
        samples; BadRequest past the episode's limits."""
        if ep.stats["turns"] + sum(1 for p in self._pending if p.episode is ep) >= self.max_turns:
            ep.stats["truncated"] = 1.0
            raise BadRequest(f"the episode has made rollout.max_turns={self.max_turns} calls: no more")
        parent, context, ids = self._extend(ep, r)
        if parent is None and len(ids) > self.max_prompt_length:
            raise BadRequest(
                f"the prompt is {len(ids)} tokens, more than data.max_prompt_length={self.max_prompt_length}",
                "messages" if r.chat else "prompt",
            )
        used = len(parent.chain.response_ids) + len(context) if parent is not None else 0
        room = self._params.max_new_tokens - used
        if room < 1:
            ep.stats["truncated"] = 1.0
            raise BadRequest(
                f"the episode's sample holds rollout.max_new_tokens={self._params.max_new_tokens} response "
                "tokens (generated and context): no room for another completion"
            )
        cap = min(r.max_tokens or room, room)
        seed = ep.sample.seed
        samples = [
            Sample(
                ep.sample.prompt,
                list(ids),
                group_id=ep.sample.group_id,
                index=next(self._numbers),
                max_new_tokens=cap,
                seed=None if seed is None else seed * 1009 + len(ep.calls) * 31 + k,
            )
            for k in range(r.n)
        ]
        return Pending(r, ep, ids, parent, context, samples, time.monotonic(), self._loop.create_future())

    def _extend(self, ep: Episode, r: Request) -> tuple[Served | None, list[int], list[int]]:
        """(the choice this request extends, the ids between, the whole prompt ids)."""
        for call in reversed(ep.calls):
            for choice in call.choices:
                found = self._continues(call, choice, r)
                if found is not None:
                    return choice, found, call.prompt_ids + choice.ids + found
        if r.chat:
            return None, [], self._chat().prompt(r.messages, r.tools)
        if isinstance(r.prompt, list):
            return None, [], list(r.prompt)
        return None, [], self.tokenizer.encode(r.prompt, add_special_tokens=False)

    def _continues(self, call: Call, choice: Served, r: Request) -> list[int] | None:
        """The context ids when `r` extends `choice` of `call`, else None."""
        if r.chat and call.messages is not None:
            n = len(call.messages)
            if len(r.messages) <= n + 1 or r.messages[:n] != call.messages:
                return None
            if not same_message(r.messages[n], choice.message or {}):
                return None
            return self._chat().continuation(
                r.messages[: n + 1], r.messages[n + 1 :], r.tools, choice.ended_on_eos
            )
        if not r.chat and call.messages is None:
            if isinstance(r.prompt, list):
                head = call.prompt_ids + choice.ids
                return list(r.prompt[len(head) :]) if r.prompt[: len(head)] == head else None
            if call.prompt_text is not None and r.prompt.startswith(call.prompt_text + choice.text):
                rest = r.prompt[len(call.prompt_text + choice.text) :]
                return self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
        return None

    def _chat(self) -> ChatRenderer:
        if self._renderer is None:
            try:
                self._renderer = ChatRenderer(self.tokenizer)
            except TandemError as e:
                raise BadRequest(str(e)) from None
        return self._renderer

    # -- the agents' side: the asyncio loop --------------------------------------------------------
    async def _episode(self, ep: Episode) -> None:
        # A connection pool of its own per episode: one pool shared by hundreds of concurrent
        # episodes made their requests reach the endpoint over ~5 s instead of ~0.3 s (measured,
        # 128 episodes); and no TLS to set up (~20 ms a client with it) on a plain-HTTP localhost.
        http = self._openai.DefaultAsyncHttpxClient(verify=False, timeout=self.timeout_s + 10.0)
        client = self._openai.AsyncOpenAI(
            base_url=self._server.base_url,
            api_key="tandem",
            default_headers={EPISODE_HEADER: ep.id},
            max_retries=0,
            timeout=self.timeout_s + 10.0,
            http_client=http,
        )
        try:
            out = await asyncio.wait_for(self.fn(client, ep.task), self.timeout_s)
            reward, info = out if isinstance(out, tuple) else (out, {})
            ep.reward, ep.info = float(reward), dict(info or {})
        except asyncio.TimeoutError:
            self._fail(ep, "timeouts", f"ran past rollout.agent_timeout_s={self.timeout_s:g} s", cancel=False)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the agent's own failure ends its episode, not the run
            if not ep.aborted:  # (one the abort caused is not its own: the episode starts afresh)
                self._fail(ep, "errors", f"raised {type(e).__name__}: {e}", cancel=False)
        finally:
            with self._cond:
                ep.ended = True
                self._cond.notify_all()
            await http.aclose()

    def _refused(self, episode: str | None, error: BadRequest) -> None:
        """The endpoint refused a request: counted in its episode's agent/bad_requests."""
        with self._cond:
            ep = self._episodes.get(episode or "")
            if ep is not None:
                ep.stats["bad_requests"] += 1

    def _fail(self, ep: Episode, kind: str, why: str, cancel: bool = True) -> None:
        """End the episode with reward 0, counted under agent/<kind>; `cancel` its coroutine when
        it is still running (not from inside it)."""
        with self._cond:
            ep.stats[kind] = 1.0
            ep.ended = True
            self._cond.notify_all()
        if cancel and ep.future is not None and not ep.future.done():
            ep.future.cancel()
        self._log_once(kind, f"an episode ended with reward 0: the agent {why}")

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s (agent/%s counts them; logged once per worker)", message, kind)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _start(self) -> None:
        if self._server is not None:
            return
        try:
            import openai  # ~1 s: before any episode's clock starts
        except ImportError:
            raise TandemError(
                "rollout.agent=openai:... gives each agent an `openai.AsyncOpenAI` client, and the openai "
                'package is not installed: pip install openai (or pip install -e ".[agents]").'
            ) from None
        warm = openai.AsyncOpenAI(api_key="tandem", base_url="http://127.0.0.1:9/v1")
        _ = warm.chat.completions, warm.completions, warm.models  # their lazy imports: seconds, once
        self._openai = openai
        from tandem.agent.openai_server import EndpointServer  # needs openai: imported after the check

        self._server = EndpointServer(self._request, self.model_name, self._refused)
        self._loop = self._server.loop  # the episodes run on the server's loop

    def close(self) -> None:
        if self._server is not None:
            self._server.close()  # and its loop
            self._server = None


_TAGGED_CALL = re.compile(r"<(\w+)>(.*?)</\1><result>(.*?)</result>", re.DOTALL)


def _fill(s: Sample, chain: Chain, reward: float, finish: str) -> None:
    """`s` becomes the chain's tokens, FINISHED with the episode's reward."""
    s.prompt_ids = list(chain.prompt_ids)
    s.response_ids, s.logprobs = list(chain.response_ids), list(chain.logprobs)
    s.versions, s.loss_mask = list(chain.versions), list(chain.loss_mask)
    s.agent_reward = reward
    s.end("length" if finish == "length" else "stop")


def _settle(future: asyncio.Future, answer: tuple[list[Choice], int] | BadRequest) -> None:
    if future.done():  # the request gave up waiting (past its episode's time limit)
        return
    if isinstance(answer, BadRequest):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def _cut(text: str, stop: list[str]) -> str:
    """OpenAI's rule: the text ends before its first stop string."""
    found = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(found)] if found else text
