"""The calculator task (recipes/quickstart_agent.yaml) as an agent function: the same environment, driven
through an OpenAI client instead of the native reset/step loop.

    env:
      agent: examples/agents/calculator_agent.py:calculator_agent

The agent asks the policy for a turn, hands the turn's text to the calculator environment
(`rewards.envs.calculator`), sends each tool result back as a `tool` message, and returns the environment's
verdict as the episode's reward. It sends exactly what the native path appends (the tool results of a turn,
joined by newlines, in the tool turn of the chat template), so with the same seeds both paths decode the same
tokens (tests/serve/test_gateway.py checks it). Any harness written against the OpenAI API plugs in the same way.
"""
import json

from rewards.envs.calculator import calculator_env


def turn_text(message) -> str:
    """What the model wrote, as the environment reads it: the content, then the calls in `<tool_call>` form."""
    calls = "".join("<tool_call>" + json.dumps({"name": c.function.name, "arguments": json.loads(c.function.arguments)})
                    + "</tool_call>" for c in message.tool_calls or [])
    return (message.content or "") + calls


async def calculator_agent(client, row: dict, max_turns: int = 3) -> dict:
    """One episode of the calculator task through `client` (an `openai.AsyncOpenAI`); returns a record whose
    "reward" is 1.0 when the final boxed answer is right."""
    env = calculator_env(max_turns=max_turns)
    env.reset(row)
    messages = [{"role": "user", "content": row["prompt"]}]
    calls = 0
    while True:
        r = await client.chat.completions.create(model="policy", messages=messages, tools=env.specs)
        message = r.choices[0].message
        obs, reward, done, info = env.step(turn_text(message))
        calls += len(info.get("tool_calls") or [])
        if done:
            return {"reward": reward, "tool_calls": calls}
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls or []] or None})
        ids = [c.id for c in message.tool_calls or []]
        for k, rec in enumerate(info["tool_calls"]):
            messages.append({"role": "tool", "tool_call_id": ids[k] if k < len(ids) else None, "content": rec["result"]})
