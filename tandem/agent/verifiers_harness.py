"""`tandem-chat`: a verifiers harness that runs the chat loop in the rollout worker's own process.

A verifiers harness is the program the model runs in; its model calls go to the rollout's
interception server, which builds the trace the rubric reads and forwards each call to the
model's endpoint (here, the rollout worker's own: `tandem.agent.verifiers_env`). verifiers' `null`
harness is a tool-less chat loop too, but a program: every rollout prepares it with `uv` (from
astral.sh, its packages from PyPI) and starts a Python process (about a second of CPU), which
fails offline and costs more than the episode. verifiers allows a harness to run its loop
in-process as long as every model call goes through the interception endpoint (`Harness.launch`);
this one does: one chat completion per segment, on the task's prompt, or on the whole
conversation when the environment's user speaks again (`Harness.resume`, `SUPPORTS_RESUME`).

Every call also carries the tandem episode's id (`X-Tandem-Episode`), which the interception
server passes on to the worker's endpoint: the episode sets `EPISODE` before it runs the
environment, and the harness runs inside that episode's asyncio task. So all episodes share one
model client (one connection pool) in the interception server, instead of one client per episode
that lives as long as the server.

verifiers finds a harness by the name of a top-level module exporting it (`--env.agent.harness.id
tandem-chat` imports `tandem_chat`); this module registers itself under that name when imported.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from tandem.agent.openai_server import EPISODE_HEADER

HARNESS_ID = "tandem-chat"
EPISODE: ContextVar[str | None] = ContextVar("tandem_episode", default=None)


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = HARNESS_ID


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per segment, in-process; no tools (a task with tool servers is refused
    when its run is paired with this harness)."""

    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt is a system message
    SUPPORTS_RESUME = True  # a user turn relaunches it on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        episode = EPISODE.get()
        # verify=False: no TLS context to build (~20 ms a client) for a plain-HTTP localhost.
        async with openai.AsyncOpenAI(
            base_url=endpoint,
            api_key=secret,
            max_retries=0,
            default_headers={EPISODE_HEADER: episode} if episode else None,
            http_client=openai.DefaultAsyncHttpxClient(verify=False),
        ) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness", "ChatHarnessConfig"]

sys.modules.setdefault(HARNESS_ID.replace("-", "_"), sys.modules[__name__])
