"""`coli serve`'s `/v1/responses` through the official `openai` Python client.

Usage: python tests/serve/responses_client.py http://127.0.0.1:PORT/v1

Run by tests/serve/openai.rs against a server on olmoe_trained (a model without a syntax for
calls: text, whole and streamed, and the refusals) and one on kimi_k3_tiny (a random model
with one: the calls `tool_choice` names, whole and streamed, constrained to the tools'
schemas, their results sent back, and a `text.format` schema). Greedy throughout, so a
streamed answer is the whole one. Prints OK, or exits non-zero saying what failed.
"""

import json
import sys
import urllib.request

import jsonschema
import openai


def check(condition, message):
    if not condition:
        sys.exit(f"responses_client.py: FAILED: {message}")


# Short strings and small integers: the fixture's random model fills what the schema
# allows, and the whole call must fit in max_output_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def valid(arguments, schema, where):
    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError as err:
        check(False, f"{where}: {arguments}: {err.message}")


def refused(call, field, kind=openai.BadRequestError):
    """`call()` fails with the client's `kind`, its message naming `field`."""
    try:
        call()
    except kind as err:
        check(field in str(err), f"the refusal does not name {field}: {err}")
        return
    check(False, f"a request with {field} was answered")


def streamed(client, ask):
    """The events of `ask` streamed with `create(stream=True)`: their types, the text and
    the arguments of the deltas, and the last response."""
    types, text, arguments, final = [], "", "", None
    for event in client.responses.create(**ask, stream=True):
        types.append(event.type)
        check(event.sequence_number == len(types) - 1, f"{event.type}: sequence_number {event.sequence_number}")
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    check(types[:2] == ["response.created", "response.in_progress"], f"first events {types[:2]}")
    check(final is not None and types[-1] == f"response.{final.status}", f"last event {types[-1:]}")
    return types, text, arguments, final


def text_answers(client, model):
    ask = dict(model=model, input="Tell me about the sea.", instructions="Be brief.",
               temperature=0, max_output_tokens=8)
    whole = client.responses.create(**ask)
    check(whole.object == "response" and whole.id.startswith("resp_"), f"response {whole}")
    check(whole.status in ("completed", "incomplete"), f"status {whole.status}")
    if whole.status == "incomplete":
        check(whole.incomplete_details.reason == "max_output_tokens", f"incomplete {whole.incomplete_details}")
    check([item.type for item in whole.output] == ["message"], f"output {whole.output}")
    check(whole.output[0].id.startswith("msg_") and whole.output[0].role == "assistant", f"message {whole.output[0]}")
    text, usage = whole.output_text, whole.usage
    check(isinstance(text, str), f"output_text {text!r}")
    check(usage.input_tokens > 0 and 0 < usage.output_tokens <= 8, f"usage {usage}")
    check(usage.total_tokens == usage.input_tokens + usage.output_tokens, f"usage {usage}: total is not the sum")
    check(usage.output_tokens_details.reasoning_tokens == 0, f"usage {usage}")
    check(whole.temperature == 0 and whole.instructions == "Be brief.", f"echo {whole}")

    types, deltas, _, final = streamed(client, ask)
    check(deltas == text, f"streamed text {deltas!r} != whole text {text!r}")
    check(final.output_text == text and final.status == whole.status, f"streamed response {final}")
    check((final.usage.input_tokens, final.usage.output_tokens) == (usage.input_tokens, usage.output_tokens),
          f"streamed usage {final.usage} != whole usage {usage}")
    check(types[2:4] == ["response.output_item.added", "response.content_part.added"], f"events {types}")

    # The SDK's stream helper rebuilds the response from the events.
    with client.responses.stream(**ask) as stream:
        done = [event.text for event in stream if event.type == "response.output_text.done"]
    check(done == [text], f"the stream helper's text {done} != {text!r}")

    # Items without `type`, as the SDK's examples send them; a developer message.
    items = client.responses.create(**{**ask, "instructions": None, "input": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea."}]},
    ]})
    check(items.output_text == text, f"items {items.output_text!r} != the string input's {text!r}")

    refused(lambda: client.responses.create(**ask, previous_response_id="resp_1"), "previous_response_id")
    refused(lambda: client.responses.create(**ask, store=True), "store")
    refused(lambda: client.responses.create(**{**ask, "max_output_tokens": 100000}), "max_output_tokens")
    refused(lambda: client.responses.create(**{**ask, "model": "no-such-model"}), "no-such-model",
            openai.NotFoundError)


def no_calls(client, model):
    """OLMoE's model has no syntax for calls: tools are refused, naming the engine."""
    refused(lambda: client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                            tools=[{"type": "function", "name": "f"}]), "olmoe")


def tools():
    """A few tools besides `weather`, the one called."""
    declared = [{"type": "function", "name": "weather", "description": "Forecast.", "parameters": WEATHER,
                 "strict": True}]
    for i in range(3):
        declared.append({"type": "function", "name": f"tool_{i}",
                         "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}}})
    return declared


def calls(client, model):
    ask = dict(model=model, input=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=tools(),
               tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
               temperature=0, max_output_tokens=200)
    whole = client.responses.create(**ask)
    check(whole.status == "completed", f"status {whole.status}: {whole}")
    made = [item for item in whole.output if item.type == "function_call"]
    check(len(made) == 1, f"output {whole.output}")
    call = made[0]
    check(call.name == "weather" and call.status == "completed", f"call {call}")
    check(call.call_id.startswith("call_") and call.id.startswith("fc_"), f"call ids {call}")
    valid(json.loads(call.arguments), WEATHER, "function_call arguments")
    check(whole.tool_choice.name == "weather" and not whole.parallel_tool_calls, f"echo {whole}")

    types, _, arguments, final = streamed(client, ask)
    check(arguments == call.arguments, f"streamed arguments {arguments} != {call.arguments}")
    check("response.function_call_arguments.done" in types, f"events {types}")
    check([i.arguments for i in final.output if i.type == "function_call"] == [call.arguments],
          f"streamed response {final.output}")
    with client.responses.stream(**ask) as stream:
        for _ in stream:
            pass
        helper = stream.get_final_response()
    check([i.arguments for i in helper.output if i.type == "function_call"] == [call.arguments],
          f"the stream helper's output {helper.output}")

    # The agent's next turn: the response's output items and the call's result go back.
    second = ask["input"] + [item.model_dump(exclude_none=True) for item in whole.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C and snow"},
    ]
    answer = client.responses.create(**{**ask, "input": second, "tool_choice": "auto", "max_output_tokens": 8})
    check(answer.status in ("completed", "incomplete") and answer.output, f"second turn {answer}")
    check(answer.usage.input_tokens > whole.usage.input_tokens, f"second turn usage {answer.usage}")
    cached = answer.usage.input_tokens_details.cached_tokens
    check(cached >= whole.usage.input_tokens, f"second turn: {cached} cached of the first turn's {whole.usage.input_tokens}")
    refused(lambda: client.responses.create(**{**ask, "input": second[:1] + second[-1:]}), "call_id")

    # Structured output: the text is JSON that the schema accepts.
    structured = client.responses.create(
        model=model, input="The weather?", temperature=0, max_output_tokens=300,
        text={"format": {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}},
    )
    check(structured.status == "completed", f"structured: {structured}")
    valid(json.loads(structured.output_text), WEATHER, "text.format")
    refused(lambda: client.responses.create(model=model, input="x", max_output_tokens=4, text={
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}), "text.format")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: responses_client.py http://127.0.0.1:PORT/v1")
    base = sys.argv[1]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health") as health:
        engine = json.load(health)["engine"]
    if engine == "olmoe":
        text_answers(client, model)
        no_calls(client, model)
    else:
        calls(client, model)
    print("OK")


if __name__ == "__main__":
    main()
