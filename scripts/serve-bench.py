#!/usr/bin/env python3
"""serve-bench.py: load an OpenAI-style server with concurrent streamed completions.

Each client sends one streamed `/v1/completions` request whose prompt is token ids (the same
ids for any server, so coli and llama-server read the same prompt), greedy, and reads its
chunks as they come. Per client count it prints one line: aggregate completion tokens per
second (all tokens over the wall time from the first request to the last answer), time to
first token (p50/p95 over the clients) and time between tokens (p50/p95 over every gap of
every client, a chunk that carries k tokens counting as k gaps of equal share).

    serve-bench.py --url http://127.0.0.1:8080 --clients 1,2,4,8 --prompt 40 --tokens 64 \
        --vocab 50304 [--long 4000] [--rounds 2]

--ids FILE takes each prompt from a file of token ids (whitespace-separated) at a random
offset instead of random ids: real text routes as real text does. Against coli, each line
also gives the experts read from the shards per generated token (from /metrics).

--long N adds, in every round with more than one client, one more client whose prompt is N
tokens, sent once the others are decoding: the others' largest gap then shows how long a
prompt being filled holds up the sequences that decode (chunked prefill).

Only the standard library: it runs anywhere python3 does.
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def one_request(url, prompt, tokens, result, started):
    parts = urllib.parse.urlparse(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    sent = time.monotonic()
    started.append(sent)
    connection.request(
        "POST", "/v1/completions", body, {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if response.status != 200:
        result["error"] = f"HTTP {response.status}: {response.read()[:300]!r}"
        return
    arrivals = []  # read live by a round that waits for every client's first token
    result["arrivals"] = arrivals
    usage = None
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            # A chunk before the finishing one carries a token (llama-server sends one per
            # token even when its text is empty).
            if choice.get("finish_reason") is None:
                arrivals.append(time.monotonic())
    ended = time.monotonic()
    connection.close()
    count = usage["completion_tokens"] if usage else len(arrivals)
    result.update(sent=sent, ended=ended, arrivals=arrivals, tokens=count)


TEXT_IDS = []


def prompt_ids(rng, vocab, length):
    if TEXT_IDS:
        start = rng.randrange(0, len(TEXT_IDS) - length)
        return TEXT_IDS[start : start + length]
    # Ids from the middle of the vocabulary: ordinary text pieces, no special tokens.
    return [rng.randrange(vocab // 50, vocab * 4 // 5) for _ in range(length)]


def experts_read(url):
    """coli's count of experts read from the shards so far; None for another server."""
    parts = urllib.parse.urlparse(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        for line in connection.getresponse().read().decode().splitlines():
            if line.startswith("coli_step_experts_read_total "):
                return float(line.split()[1])
    except (OSError, http.client.HTTPException):
        pass
    return None


def run_round(args, clients, rng):
    results = [dict() for _ in range(clients)]
    started = []
    threads = [
        threading.Thread(
            target=one_request,
            args=(args.url, prompt_ids(rng, args.vocab, args.prompt), args.tokens, r, started),
        )
        for r in results
    ]
    long_result = None
    for t in threads:
        t.start()
    if args.long and clients > 1:
        # Once every client has its first token, a long prompt arrives.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not all(
            len(r.get("arrivals", [])) or "error" in r for r in results
        ):
            time.sleep(0.01)
        long_result = {}
        long_thread = threading.Thread(
            target=one_request,
            args=(args.url, prompt_ids(rng, args.vocab, args.long), 8, long_result, []),
        )
        # The others' arrivals are read live; mark when the long prompt was sent.
        long_sent = time.monotonic()
        long_thread.start()
        long_thread.join()
        long_result["sent_at"] = long_sent
    for t in threads:
        t.join()
    return results, long_result


def gaps_of(result):
    arrivals = result["arrivals"]
    if len(arrivals) < 2:
        return []
    # A chunk may carry several tokens (drafts accepted, bytes held back): share the time.
    share = max(1, result["tokens"] - 1) / (len(arrivals) - 1)
    return [
        (b - a) / share
        for a, b in zip(arrivals, arrivals[1:])
        for _ in range(max(1, int(round(share))))
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--long", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--label", default="")
    parser.add_argument("--ids", default="")
    args = parser.parse_args()
    if args.ids:
        TEXT_IDS.extend(int(i) for i in open(args.ids).read().split())
    rng = random.Random(args.seed)
    for clients in [int(c) for c in args.clients.split(",")]:
        for round_ in range(args.rounds):
            read_before = experts_read(args.url)
            results, long_result = run_round(args, clients, rng)
            read_after = experts_read(args.url)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                print(f"{args.label} clients {clients}: {errors[0]}", file=sys.stderr)
                sys.exit(1)
            first = min(r["sent"] for r in results)
            last = max(r["ended"] for r in results)
            tokens = sum(r["tokens"] for r in results)
            ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
            gaps = [g for r in results for g in gaps_of(r)]
            line = (
                f"{args.label} clients {clients} round {round_ + 1}: {tokens} tokens in "
                f"{last - first:.2f} s = {tokens / (last - first):.1f} tok/s | TTFT p50 "
                f"{percentile(ttft, 0.5) * 1e3:.0f} ms p95 {percentile(ttft, 0.95) * 1e3:.0f} ms"
                f" | TBT p50 {percentile(gaps, 0.5) * 1e3:.1f} ms p95 "
                f"{percentile(gaps, 0.95) * 1e3:.1f} ms max {max(gaps, default=0) * 1e3:.0f} ms"
            )
            if read_before is not None and read_after is not None:
                line += f" | {(read_after - read_before) / tokens:.1f} experts read per generated token (prompts included)"
            if long_result is not None:
                if "error" in long_result:
                    print(f"long prompt: {long_result['error']}", file=sys.stderr)
                    sys.exit(1)
                sent = long_result["sent_at"]
                # Gaps of the other clients while the long prompt was being filled.
                filled = long_result["arrivals"][0] if long_result["arrivals"] else sent
                during = [
                    b - a
                    for r in results
                    for a, b in zip(r["arrivals"], r["arrivals"][1:])
                    if b > sent and a < filled
                ]
                line += (
                    f" | {args.long}-token prompt: its first token after "
                    f"{(filled - sent):.2f} s, the others' largest gap meanwhile "
                    f"{max(during, default=0) * 1e3:.0f} ms"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
