"""An agent as users write them, a plain `openai` client and one tool, trained through `envs.agent:AgentEnv`:

    env: {cls: envs.agent:AgentEnv, kwargs: {agent: envs.examples.calculator_agent:run}}

It asks the question with a calculator tool, runs the calls the model makes and sends their results back,
for at most `MAX_CALLS` model calls; the reward is whether the last answer holds the sample's `answer`.
The tool is spelt as the tool recipe's `calc(expr)` (envs/arithmetic_tools.py), the one the shipped
tool-calling policy learnt to call, so that policy calls it here too: configs/grpo_agent_arithmetic.yaml.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

from envs.calculator import format_number, safe_eval

MAX_CALLS = 2
CALCULATOR = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression such as 12 * (3 + 4).",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


def calculate(expression: str) -> str:
    try:
        return format_number(safe_eval(expression))
    except (ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: {err}"


async def run(base_url: str, sample: dict) -> dict:
    """The agent function: one trajectory, driven through the job's OpenAI-compatible endpoint.

    Args:
        base_url: This trajectory's endpoint (`.../v1`): every chat completion asked of it is one action.
        sample: The prompt's dataset row; here its `messages` and its `answer`.

    Returns:
        The reward under `reward`, and numbers of the agent's own (here `tool_calls`), logged as
            `rollout/agent/<key>`.
    """
    messages = list(sample["messages"])
    calls = 0
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        for turn in range(MAX_CALLS):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or turn == MAX_CALLS - 1:  # answered, or no call left to read the results
                break
            for call in message.tool_calls:
                calls += 1
                expression = json.loads(call.function.arguments).get("expr", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    correct = str(sample.get("answer")) in (message.content or "")
    return {"reward": float(correct), "tool_calls": calls}
