"""`rollout.agent=openai:pkg.module:function`: agents written against the OpenAI API.

The user's agent is an ordinary coroutine, `async def run(client: openai.AsyncOpenAI, task: dict)
-> float` (the episode's reward) or `-> (float, info)`. For every sample of a generate call the
rollout worker starts one episode: it calls the function with a client whose `base_url` is the
worker's own OpenAI-compatible endpoint (`openai_server.py`) and whose requests carry the episode's
id, and records every token the engine generated for it.

Its parts: `chains.py` records each episode as chains of completions (what a request extends,
what becomes training samples), `batcher.py` holds the requests until one engine call serves them
together, `answers.py` turns the engine's samples into the choices a request gets, and
`demonstrations.py` writes `tandem sft`'s demonstrations as such chains.

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
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tandem.agent.answers import answer, settle
from tandem.agent.batcher import Batcher, Pending
from tandem.agent.chains import FAULTS, Call, Chain, Episode, Served
from tandem.agent.chat import ChatRenderer
from tandem.agent.demonstrations import demonstration
from tandem.agent.loop import AgentLoop, Turn
from tandem.agent.openai_request import EPISODE_HEADER, BadRequest, Choice, Request
from tandem.agent.specs import load_agent_fn
from tandem.agent.tools import openai_tool
from tandem.errors import TandemError
from tandem.sample import Prompt, Sample, SamplingParams, Status

if TYPE_CHECKING:
    from tandem.agent.openai_server import EndpointServer

log = logging.getLogger(__name__)

SCRATCH_INDEX = 1 << 20  # engine requests are numbered from here, apart from the samples' own keys


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
        self._batcher = Batcher(self._cond)
        self._logged: set[str] = set()
        self._numbers = itertools.count(SCRATCH_INDEX)

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
            batch = self._batcher.next_batch(episodes, self.timeout_s, self._hung)
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

    def _hung(self, ep: Episode) -> None:
        """Give up on an agent past its deadline (its coroutine is cancelled)."""
        self._fail(ep, "timeouts", f"ran past rollout.agent_timeout_s={self.timeout_s:g} s")

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
            self._batcher.put_back(retry)
        return True

    def _answer(self, p: Pending, params: SamplingParams) -> None:
        """Turn the engine's samples into choices, record them in the episode, release the request."""
        r, ep = p.request, p.episode
        eos = getattr(self.tokenizer, "eos_token_id", None)
        parent_chain = p.parent.chain if p.parent is not None else Chain(p.prompt_ids)
        choices, served = [], []
        for s in p.samples:
            choice, parse_error = answer(s, r, self.tokenizer, self.tool_parser)
            if parse_error:
                ep.stats["tool_parse_errors"] += 1
                self._log_once("tool_parse_errors", f"a tool call could not be read: {parse_error}")
            ep.stats["tool_calls"] += len(choice.tool_calls)
            choices.append(choice)
            served.append(Served.of(parent_chain.then(p.context, s), s, choice, r.chat, eos))
        prompt_text = r.prompt if isinstance(r.prompt, str) else None
        call = Call(r.messages if r.chat else None, prompt_text, p.prompt_ids, served)
        with self._cond:
            ep.record(call, p.parent, p.context)
        self._reply(p, (choices, len(p.prompt_ids)))

    def _reply(self, p: Pending, answer: tuple[list[Choice], int] | BadRequest) -> None:
        """Hand the request its answer (or its refusal) on the endpoint's loop, where it waits."""
        self._loop.call_soon_threadsafe(settle, p.answer, answer)

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
        extras = ep.samples(ep.reward if not any(ep.stats[f] for f in FAULTS) else 0.0)
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
        """A transcript in the tools' tag format as the endpoint's chain holds such an episode
        (`tandem.agent.demonstrations`)."""
        return demonstration(self._chat(), self.tokenizer.eos_token_id, self.tools, text)

    # -- the endpoint's side: requests from the agents --------------------------------------------
    async def _request(self, r: Request) -> tuple[list[Choice], int]:
        """The endpoint's backend (on its loop): queue the request, await the engine's answer."""
        with self._cond:
            ep = self._episodes.get(r.episode)
            if ep is None or ep.ended:
                raise BadRequest(f"episode {r.episode!r} is not running on this worker", status=404)
            pending = self._prepare(ep, r)
            self._batcher.put(pending)
        try:
            return await asyncio.wait_for(pending.answer, max(ep.deadline - time.monotonic(), 0) + 5.0)
        except asyncio.TimeoutError:
            raise BadRequest("the episode ran past its time limit", status=408) from None

    def _prepare(self, ep: Episode, r: Request) -> Pending:
        """The request's prompt ids (extending an earlier completion where it can) and its engine
        samples; BadRequest past the episode's limits."""
        if ep.stats["turns"] + self._batcher.waiting(ep) >= self.max_turns:
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
        found = ep.extension(r, self._chat, self.tokenizer)
        if found is not None:
            return found
        if r.chat:
            return None, [], self._chat().prompt(r.messages, r.tools)
        if isinstance(r.prompt, list):
            return None, [], list(r.prompt)
        return None, [], self.tokenizer.encode(r.prompt, add_special_tokens=False)

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
