"""`coli serve` through the official `anthropic` Python client (Messages).

Usage: python tests/serve/anthropic_client.py http://127.0.0.1:PORT

Run by tests/serve/openai.rs against a server on the olmoe_trained fixture; prints OK, or
exits non-zero saying what failed.
"""

import sys

import anthropic


def check(condition, message):
    if not condition:
        sys.exit(f"anthropic_client.py: FAILED: {message}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: anthropic_client.py http://127.0.0.1:PORT")
    client = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
    ask = dict(
        model="olmoe",  # the engine name: the server takes it as well as its id
        max_tokens=8,
        # Greedy. The client's own arguments no longer include the sampling fields, which
        # the API still takes in the body.
        extra_body={"temperature": 0},
        system="You answer briefly.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "The history of"}]}],
    )

    # Whole and streamed: greedy, so the same text, stop reason and token counts.
    whole = client.messages.create(**ask)
    check(whole.type == "message" and whole.role == "assistant", f"message {whole}")
    check(whole.id.startswith("msg_"), f"id {whole.id}")
    check(len(whole.content) == 1 and whole.content[0].type == "text", f"content {whole.content}")
    text = whole.content[0].text
    check(whole.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {whole.stop_reason}")
    check(whole.usage.output_tokens >= 1, f"usage {whole.usage}")

    events = []
    start_usage = None
    with client.messages.stream(**ask) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "message_start":
                start_usage = event.message.usage
        streamed = stream.get_final_message()
    # message_start already counts the prompt (what it computes and what the cache held).
    check(
        start_usage.input_tokens + start_usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens,
        f"message_start usage {start_usage} against {whole.usage}",
    )
    check(streamed.content[0].text == text, f"streamed {streamed.content[0].text!r} != {text!r}")
    check(streamed.stop_reason == whole.stop_reason, f"{streamed.stop_reason} != {whole.stop_reason}")
    check(streamed.usage.output_tokens == whole.usage.output_tokens, f"{streamed.usage} != {whole.usage}")
    kinds = [e for e in events if e != "text"]
    check(kinds[0] == "message_start" and kinds[1] == "content_block_start", f"events {kinds}")
    check(kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], f"events {kinds}")
    check(all(k == "content_block_delta" for k in kinds[2:-3]), f"events {kinds}")

    # The same prompt again: its prefix comes from the cache, and the usage says so.
    again = client.messages.create(**ask)
    check(again.usage.cache_read_input_tokens > 0, f"nothing read from the cache: {again.usage}")
    check(
        again.usage.input_tokens + again.usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens,
        f"{again.usage} and {whole.usage} count different prompts",
    )

    # A stop sequence: cut before it, and named.
    if len(text) > 2:
        stop = text[1:3]
        cut = client.messages.create(**dict(ask, stop_sequences=[stop]))
        check(cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, f"stop {cut}")
        check(cut.content[0].text == text[: text.index(stop)], f"cut {cut.content[0].text!r}")

    # A last assistant message starts the answer, which continues it: the prompt holds it.
    prefilled = client.messages.create(
        **dict(ask, messages=ask["messages"] + [{"role": "assistant", "content": "Once upon a"}])
    )
    total = lambda u: u.input_tokens + u.cache_read_input_tokens
    check(total(prefilled.usage) > total(whole.usage), f"prefill {prefilled.usage} vs {whole.usage}")
    check(prefilled.content[0].type == "text", f"prefill {prefilled.content}")
    try:
        client.messages.create(**dict(ask, messages=ask["messages"] + [{"role": "assistant", "content": "Once "}]))
        check(False, "a prefill ending in whitespace was accepted")
    except anthropic.BadRequestError as err:
        check("whitespace" in str(err), f"prefill refusal: {err}")

    # Errors arrive as the client's exception types.
    try:
        client.messages.create(**dict(ask, tools=[{"name": "f", "input_schema": {"type": "object"}}]))
        check(False, "tools were not refused")
    except anthropic.BadRequestError as err:
        check("tools" in str(err), f"the refusal does not name tools: {err}")
    try:
        client.messages.create(**dict(ask, model="claude-opus"))
        check(False, "an unknown model was not refused")
    except anthropic.NotFoundError:
        pass
    print("OK")


if __name__ == "__main__":
    main()
