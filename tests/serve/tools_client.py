"""Tool calls and structured output of `coli serve` through the official `openai` and
`anthropic` Python clients, as a coding agent drives them.

Usage: python tests/serve/tools_client.py http://127.0.0.1:PORT

Run by tests/serve/openai.rs against servers on tiny random fixtures that have a syntax for
calls (GLM-5.2, Kimi K3). A random model calls no tool of its own will, so the calls here
are the ones `tool_choice` requires: decoding is constrained to the model's call syntax and
the tools' schemas, and the server parses what it generated back into calls. Prints OK, or
exits non-zero saying what failed.
"""

import json
import sys

import anthropic
import jsonschema
import openai


def check(condition, message):
    if not condition:
        sys.exit(f"tools_client.py: FAILED: {message}")


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def tools():
    """Twenty tools, as a coding agent declares them (short: the fixtures' tokenizers spend
    a token on a character or two, in a 4,096-token context); `weather` is the one called."""
    declared = [{"type": "function", "function": {"name": "weather", "description": "Forecast.", "parameters": WEATHER}}]
    for i in range(19):
        declared.append({
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 20}}},
            },
        })
    return declared


def weather_arguments(arguments, where):
    try:
        jsonschema.validate(arguments, WEATHER)
    except jsonschema.ValidationError as err:
        check(False, f"{where}: arguments {arguments}: {err.message}")


def openai_calls(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 4},
        {"role": "user", "content": "What is the weather in Oslo?"},
    ]
    ask = dict(model=model, messages=messages, tools=tools(), temperature=0, max_tokens=200,
               tool_choice={"type": "function", "function": {"name": "weather"}}, parallel_tool_calls=False)

    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason!r}: {choice}")
    calls = choice.message.tool_calls
    check(calls is not None and len(calls) == 1, f"tool_calls {calls}")
    call = calls[0]
    check(call.type == "function" and call.function.name == "weather", f"call {call}")
    check(call.id.startswith("call_"), f"call id {call.id}")
    weather_arguments(json.loads(call.function.arguments), "openai")

    # Streamed: the deltas assemble to the same call (greedy).
    assembled, finish = {}, None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                entry = assembled.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = delta.id or entry["id"]
                if delta.function is not None:
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
    check(finish == "tool_calls", f"streamed finish {finish!r}")
    check(list(assembled) == [0], f"streamed calls {assembled}")
    check(assembled[0]["name"] == "weather", f"streamed call {assembled[0]}")
    check(json.loads(assembled[0]["arguments"]) == json.loads(call.function.arguments),
          f"streamed arguments {assembled[0]['arguments']} != {call.function.arguments}")

    # The second turn of the agent: the call and its result go back; the tools and the
    # first turn come from the cache.
    second = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C and snow"},
    ]
    again = client.chat.completions.create(**{**ask, "messages": second, "tool_choice": "required"})
    cached = again.usage.prompt_tokens_details.cached_tokens
    check(cached >= whole.usage.prompt_tokens, f"second turn: {cached} cached of the first turn's {whole.usage.prompt_tokens}")
    check(again.choices[0].finish_reason == "tool_calls", f"second turn: {again.choices[0]}")
    for c in again.choices[0].message.tool_calls:
        check(c.function.name == "weather" or c.function.name.startswith("tool_"), f"second turn call {c}")
        arguments = json.loads(c.function.arguments)
        if c.function.name == "weather":
            weather_arguments(arguments, "second turn")
        else:
            check(all(isinstance(v, str) for v in arguments.values()), f"second turn call {c}")

    # Structured output: the content is JSON that the schema accepts.
    structured = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER, "strict": True}},
    )
    check(structured.choices[0].finish_reason == "stop", f"structured: {structured.choices[0]}")
    weather_arguments(json.loads(structured.choices[0].message.content), "response_format")

    # A schema that is not one is the request's fault, named.
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}})
        check(False, "an invalid schema was accepted")
    except openai.BadRequestError as err:
        check("response_format" in str(err), f"invalid schema: {err}")


def anthropic_calls(base):
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    ask = dict(
        model="any", max_tokens=200, extra_body={"temperature": 0},
        tools=[{"name": "weather", "description": "Forecast.", "input_schema": WEATHER}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
    )
    # The model name is checked: use the server's.
    ask["model"] = openai.OpenAI(base_url=base + "/v1", api_key="unused").models.list().data[0].id
    whole = client.messages.create(**ask)
    check(whole.stop_reason == "tool_use", f"stop_reason {whole.stop_reason}: {whole}")
    uses = [block for block in whole.content if block.type == "tool_use"]
    check(len(uses) == 1 and uses[0].name == "weather", f"content {whole.content}")
    check(uses[0].id.startswith("toolu_"), f"tool_use id {uses[0].id}")
    weather_arguments(uses[0].input, "anthropic")

    with client.messages.stream(**ask) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_message()
    streamed_uses = [block for block in streamed.content if block.type == "tool_use"]
    check(len(streamed_uses) == 1 and streamed_uses[0].input == uses[0].input, f"streamed {streamed.content}")
    check(streamed.stop_reason == "tool_use", f"streamed stop_reason {streamed.stop_reason}")

    # The result goes back in a tool_result block.
    follow = dict(ask, tool_choice={"type": "auto"}, max_tokens=4, messages=ask["messages"] + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "-3 C"}]},
    ])
    answer = client.messages.create(**follow)
    check(answer.usage.cache_read_input_tokens > 0, f"follow-up usage {answer.usage}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tools_client.py http://127.0.0.1:PORT")
    openai_calls(sys.argv[1])
    anthropic_calls(sys.argv[1])
    print("OK")


if __name__ == "__main__":
    main()
