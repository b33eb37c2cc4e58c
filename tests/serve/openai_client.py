"""`coli serve` through the official `openai` Python client.

Usage: python tests/serve/openai_client.py http://127.0.0.1:PORT/v1

Run by tests/serve/openai.rs against a server on the olmoe_trained fixture; prints OK, or
exits non-zero saying what failed.
"""

import sys

import openai


def check(condition, message):
    if not condition:
        sys.exit(f"openai_client.py: FAILED: {message}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: openai_client.py http://127.0.0.1:PORT/v1")
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)

    models = client.models.list().data
    check(len(models) == 1, f"expected one model, got {models}")
    model = models[0].id
    check(isinstance(model, str) and model, f"model id {model!r}")

    # Chat, whole and streamed: greedy, so the same text and the same token count.
    chat = dict(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        temperature=0,
        max_tokens=8,
    )
    whole = client.chat.completions.create(**chat)
    choice, usage = whole.choices[0], whole.usage
    text = choice.message.content
    check(isinstance(text, str), f"content {text!r} is not a string")
    check(choice.finish_reason in {"stop", "length"}, f"finish_reason {choice.finish_reason!r}")
    check(usage.prompt_tokens > 0, f"usage {usage}")
    check(usage.completion_tokens <= 8, f"usage {usage}: more than max_tokens")
    check(
        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens,
        f"usage {usage}: total is not the sum",
    )

    streamed, stream_usage, finish = "", None, None
    for chunk in client.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            stream_usage = chunk.usage
        for c in chunk.choices:
            streamed += c.delta.content or ""
            finish = c.finish_reason or finish
    check(streamed == text, f"streamed chat {streamed!r} != whole chat {text!r}")
    check(finish == choice.finish_reason, f"streamed finish {finish!r} != {choice.finish_reason!r}")
    check(stream_usage is not None, "no usage chunk with stream_options.include_usage")
    check(
        stream_usage.completion_tokens == usage.completion_tokens,
        f"streamed usage {stream_usage} != whole usage {usage}",
    )

    # Text completion, whole and streamed.
    completion = dict(model=model, prompt="The history of", max_tokens=6, temperature=0)
    whole = client.completions.create(**completion)
    text = whole.choices[0].text
    check(isinstance(text, str), f"completion text {text!r}")
    check(whole.usage.completion_tokens <= 6, f"completion usage {whole.usage}")
    streamed = "".join(
        c.text for chunk in client.completions.create(**completion, stream=True) for c in chunk.choices
    )
    check(streamed == text, f"streamed completion {streamed!r} != whole completion {text!r}")

    # Errors arrive as the client's exception types.
    try:
        client.chat.completions.create(**{**chat, "model": "no-such-model"})
        check(False, "an unknown model was served")
    except openai.NotFoundError:
        pass
    try:
        client.chat.completions.create(**{**chat, "max_tokens": 100000})
        check(False, "max_tokens 100000 was accepted on a 4096-token model")
    except openai.BadRequestError:
        pass

    # OLMoE's model has no syntax for calls: tools are refused, naming the engine.
    try:
        client.chat.completions.create(**chat, tools=[{"type": "function", "function": {"name": "f"}}])
        check(False, "tools were accepted by a model without a call syntax")
    except openai.BadRequestError as err:
        check("olmoe" in str(err), f"tools on OLMoE: {err}")
    # tool_choice none leaves the tools out: answered as without them.
    plain = client.chat.completions.create(
        **chat, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"
    )
    reference = client.chat.completions.create(**chat).choices[0].message.content
    check(plain.choices[0].message.content == reference, f"tool_choice none: {plain.choices[0]}")

    print("OK")


if __name__ == "__main__":
    main()
