"""Agents: loops that run above a rollout engine (multi-turn tool use), and the tools they call."""

from tandem.agent.build import AGENT_KINDS, agent_class, build_agent, endpoint_agent
from tandem.agent.loop import AGENTS, AgentLoop, SingleTurn, ToolAgent, context_end
from tandem.agent.tools import TOOLS, Tool, ToolError

__all__ = [
    "AGENTS",
    "AGENT_KINDS",
    "TOOLS",
    "AgentLoop",
    "SingleTurn",
    "Tool",
    "ToolAgent",
    "ToolError",
    "agent_class",
    "build_agent",
    "context_end",
    "endpoint_agent",
]
