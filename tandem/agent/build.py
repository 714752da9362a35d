"""Building the agent a config names (`rollout.agent`): a registered loop, a user's
`pkg.module:Class`, or an agent of the ecosystem behind the OpenAI-compatible endpoint
(`openai:...`, `verifiers:...`). Apart from loop.py so that the contract does not import the
agents built on it."""

import functools
from collections.abc import Callable, Sequence

from tandem.agent.loop import AGENTS, AgentLoop
from tandem.agent.specs import load_agent_fn
from tandem.errors import TandemError
from tandem.loading import LoadError, load
from tandem.registry import Registry

# The agent kinds a prefix names ("<kind>:pkg.module:function"): episodes of the ecosystem that run
# behind the OpenAI-compatible endpoint, take the OpenAI agent's settings and give their own
# rewards. One entry each: the spec -> the agent class, bound to what the spec names. A new kind is
# one registered function.
AGENT_KINDS: Registry[Callable[[str], Callable[..., AgentLoop]]] = Registry("agent kind")


@AGENT_KINDS.register("openai")
def _openai_agent(spec: str) -> Callable[..., AgentLoop]:
    """`OpenAIAgent` bound to the user's coroutine function."""
    from tandem.agent.openai_agent import OpenAIAgent

    load_agent_fn(spec)  # a missing module or a function that is not async: said now
    return functools.partial(OpenAIAgent, fn=spec)


@AGENT_KINDS.register("verifiers")
def _verifiers_agent(spec: str) -> Callable[..., AgentLoop]:
    """`VerifiersAgent` bound to the environment (tandem/agent/verifiers_env.py)."""
    from tandem.agent.verifiers_env import VerifiersAgent, build_env

    # built now: a missing package, module or function, a seat tandem cannot serve are said here
    return functools.partial(VerifiersAgent, env=build_env(spec))


def endpoint_agent(spec: str) -> bool:
    """Whether `spec` names an agent kind of AGENT_KINDS (served by the endpoint, scoring itself)."""
    kind, sep, _ = spec.partition(":")
    return bool(sep) and kind in AGENT_KINDS


def agent_class(spec: str) -> Callable[..., AgentLoop]:
    """A registered agent's name, "pkg.module:Class", or "<kind>:pkg.module:function" of an agent
    kind (AGENT_KINDS) -> the class (bound to what the spec names); TandemError naming the valid
    names otherwise."""
    if spec in AGENTS:
        return AGENTS.get(spec)
    if endpoint_agent(spec):
        return AGENT_KINDS.get(spec.partition(":")[0])(spec)
    kinds = " or ".join(f"'{k}:pkg.module:function'" for k in AGENT_KINDS.names())
    forms = f"An agent is one of {', '.join(AGENTS.names())}, 'pkg.module:Class', {kinds}."
    try:
        cls = load(spec)
    except LoadError as e:
        if e.reason == "shape":
            raise TandemError(f"Unknown agent {spec!r}. {forms}") from None
        if e.reason == "import":
            raise TandemError(
                f"Cannot import module {e.module!r} of agent {spec!r}: {e.error}. {forms}"
            ) from None
        cls = None
    if cls is None or not callable(getattr(cls, "run", None)):
        module, _, attr = spec.partition(":")
        what = "has no attribute" if cls is None else "has no `run` method in"
        raise TandemError(
            f"Agent {spec!r}: module {module!r} {what} {attr!r}. An agent class implements "
            "tandem.agent.AgentLoop's contract (its docstring; docs/agents.md)."
        )
    return cls


def build_agent(spec: str, tokenizer, tools: Sequence[str] = (), max_turns: int = 1, **openai) -> AgentLoop:
    """The agent `spec` names (see `agent_class`), for a worker with this tokenizer. `openai`: the
    OpenAI agent's own settings (timeout_s, max_prompt_length, tool_parser, model_name), which
    other agents do not take."""
    extra = openai if endpoint_agent(spec) else {}
    return agent_class(spec)(tokenizer=tokenizer, tools=list(tools), max_turns=max_turns, **extra)
