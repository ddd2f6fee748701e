"""What the Messages route (``POST /v1/messages``) does beyond chat's, per request, in-process: the
request translated and dumped as the chat body vLLM gets, vLLM's answer loaded and dumped as a
Message; for a stream, the request and an 8-token chat stream translated to Anthropic's events.

Run it from the repository root (pure, no services; a few seconds)::

    .venv/bin/python bench/messages_translation.py [--calls 50] [--rounds 200]

The best of ``--rounds`` rounds of ``--calls`` calls each: short rounds are what a loaded host
disturbs least, where bench/proxy_overhead.py's end-to-end ``messages`` modes drown in its noise.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Any

import orjson

from proxy.messages_api import message_object, to_chat
from proxy.messages_stream import MessagesStream

PAYLOAD = {
    "model": "bench",
    "system": "You are a helpful assistant. Answer briefly.",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0.0,
}
TOKENS = 8


def chat_answer() -> bytes:
    message = {"role": "assistant", "content": "Paris is the capital."}
    choice = {"index": 0, "message": message, "finish_reason": "length", "stop_reason": None}
    usage = {"prompt_tokens": 20, "completion_tokens": TOKENS, "total_tokens": 28}
    return orjson.dumps({"id": "chatcmpl-1", "model": "bench", "choices": [choice], "usage": usage})


def chat_stream() -> list[bytes]:
    head: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "bench"}
    chunks = [
        head | {"choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
        for i in range(TOKENS)
    ]
    chunks.append(head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    chunks.append(head | {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 8}})
    return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    answer, events = chat_answer(), chat_stream()

    def whole() -> None:
        orjson.dumps(to_chat(PAYLOAD))
        orjson.dumps(message_object(orjson.loads(answer)))

    def stream() -> None:
        orjson.dumps(to_chat(PAYLOAD))
        translator = MessagesStream()
        for chunk in events:
            translator.feed(chunk)

    for name, call in (("json", whole), ("stream", stream)):
        best = min(timeit.repeat(call, number=args.calls, repeat=args.rounds)) / args.calls
        print(f"{name}: {best * 1e6:.1f} us a request (best of {args.rounds} x {args.calls})")
    print(f"stream: {len(events)} chat events for {TOKENS} tokens")


if __name__ == "__main__":
    main()
