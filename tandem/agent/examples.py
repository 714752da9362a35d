"""Example agents for `rollout.agent=openai:tandem.agent.examples:<name>`: ordinary `openai` code,
nothing from tandem but the reward (docs/agents.md walks through them).

- `answer`: one completion of the task's prompt, scored by the task's own verifier (the default
  task through the endpoint: `tandem train rollout.agent=openai:tandem.agent.examples:answer`).
- `calculator`: chat with an OpenAI `tools` schema; each tool call is answered by tandem's
  calculator, until the model answers in text, scored by the task's verifier.
- `revise`: two chat turns, the model's answer then "Check it and answer again.": the second
  request extends the first (its prompt reuses the first turn's token ids); the last answer scored.
"""

import json

from tandem.agent.tools import ToolError, calculate
from tandem.reward.verifiers import VERIFIERS

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "The exact value of an arithmetic expression, e.g. 37*48.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def score(task: dict, text: str) -> float:
    """The task's own verifier (by its data source) on the final text."""
    return VERIFIERS.get(task["data_source"])(text, task["ground_truth"], task["extra_info"] or {})


async def answer(client, task: dict) -> float:
    """One completion of the task's prompt: chat messages, or a plain-text prompt."""
    if task["messages"]:
        reply = await client.chat.completions.create(model="policy", messages=task["messages"])
        return score(task, reply.choices[0].message.content or "")
    reply = await client.completions.create(model="policy", prompt=task["text"])
    return score(task, reply.choices[0].text)


async def calculator(client, task: dict) -> tuple[float, dict]:
    messages = list(task["messages"] or [{"role": "user", "content": task["text"]}])
    calls = 0
    for _ in range(4):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], max_tokens=100
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return score(task, message.content or ""), {"calculator_calls": calls}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except (ToolError, KeyError, json.JSONDecodeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0, {"calculator_calls": calls}


async def revise(client, task: dict) -> float:
    messages = list(task["messages"] or [{"role": "user", "content": task["text"]}])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Check it and answer again."},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return score(task, second.choices[0].message.content or "")
