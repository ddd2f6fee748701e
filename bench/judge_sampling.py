"""Judge sampling throughput: groups per minute at several ``judge.concurrency`` values, and where
vLLM's time goes (prefill or decode). The scoring side is ``bench/judge_throughput.py``.

Run it from the repository root with the embedded vLLM up (this script never starts one)::

    .venv/bin/python bench/judge_sampling.py [--group-size 4] [--concurrency 1,2,4,8]
        [--seconds 60] [--max-tokens auto|256] [--task demo|sorting|bullets|tool_use|triage]
        [--tool-choice as-sent|auto|none]

Method
------
* Prompts: the ``--task``'s (default the demo's), in order, each sampled once per run, with the
  request fields the task sends (``tools``, ``tool_choice``); the first ``--served`` of them are
  first answered once as a client would be (n=1, temperature 0, max_tokens 64 as ``ratchet
  demo`` asks) to get the served answer lengths. They are not sampled later, so vLLM's prefix
  cache holds no measured prompt from that step. ``--tool-choice auto`` samples a tool task's
  prompts with its tools but no forced call (``none``: no tools at all), to see what decoding
  a forced call under a grammar costs.
* A group is exactly what the judge sends: ``judge.sampler.sampling_body`` (one request with
  ``n=K``, logprobs and token ids) through ``judge.sampler.sample_group``; max_tokens is either a
  number (the old constant default was 256) or ``auto``: ``judge.sampler.auto_max_tokens`` on the
  served lengths, as the judge now does. Temperature 1.0 (the default of ``sampling``).
* Concurrency ``c``: ``c`` workers in a closed loop start groups until ``--seconds`` have passed,
  then the groups in flight finish; groups/min = groups / wall time of the level. Each level uses
  prompts no earlier level used.
* vLLM's ``/metrics`` are read before and after each level: the sums of the per-request prefill
  and decode time histograms (their share is where the engine spent its time per request; with
  batching they overlap, so they do not add up to wall time), prompt and generated tokens, and
  prefix-cache queries and hits (whether the K answers shared the prompt's prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from judge.sampler import auto_max_tokens, sample_group, sampling_body  # noqa: E402
from ratchet.settings import SamplingConfig, load_settings  # noqa: E402
from tasks import get_task, request_fields  # noqa: E402

SERVED_MODEL = "smollm2-135m-instruct"
METRICS = {
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "decode_s": "vllm:request_decode_time_seconds_sum",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
}


def vllm_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    totals = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        for key, name in METRICS.items():
            if re.match(re.escape(name) + r"(\{|\s)", line):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


Prompt = tuple[list[dict[str, Any]], dict[str, Any]]  # messages, and the request's other fields


def task_prompts(task: str, tool_choice: str) -> list[Prompt]:
    """The task's prompts as (messages, request fields), the fields as ``tool_choice`` says."""
    prompts = []
    for prompt in get_task(task).load_prompts():
        fields = request_fields(prompt)
        if tool_choice == "none":
            fields = {}
        elif tool_choice == "auto" and "tools" in fields:
            fields = {**fields, "tool_choice": "auto"}
        prompts.append((prompt["messages"], fields))
    return prompts


async def served_lengths(
    session: aiohttp.ClientSession, url: str, key: str, prompts: list[Prompt]
) -> list[int]:
    lengths = []
    for messages, fields in prompts:
        async with session.post(
            url + "/v1/chat/completions",
            json={
                "model": SERVED_MODEL,
                "messages": messages,
                "max_tokens": 64,
                "temperature": 0,
                **fields,
            },
            headers={"Authorization": f"Bearer {key}"},
        ) as resp:
            lengths.append((await resp.json())["usage"]["completion_tokens"])
    return lengths


async def level(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    key: str,
    prompts: Any,
    concurrency: int,
    max_tokens: int,
) -> dict[str, Any]:
    sampling = SamplingConfig(max_tokens=max_tokens)
    before = vllm_metrics(args.vllm_url)
    started = time.monotonic()
    deadline = started + args.seconds
    latencies: list[float] = []
    tokens: list[int] = []

    async def worker() -> None:
        while time.monotonic() < deadline:
            messages, fields = next(prompts)
            body = sampling_body(SERVED_MODEL, messages, fields, args.group_size, sampling)
            t0 = time.monotonic()
            group = await sample_group(session, args.vllm_url, body, 600, key)
            latencies.append(time.monotonic() - t0)
            tokens.append(sum(len(s.token_ids) for s in group.samples))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - started
    after = vllm_metrics(args.vllm_url)
    delta = {k: after[k] - before[k] for k in METRICS}
    engine = delta["prefill_s"] + delta["decode_s"]
    return {
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "groups": len(latencies),
        "wall_s": round(wall, 1),
        "groups_per_min": round(len(latencies) * 60 / wall, 2),
        "mean_group_s": round(sum(latencies) / len(latencies), 2),
        "tokens_per_group": round(sum(tokens) / len(tokens), 1),
        "prefill_share": round(delta["prefill_s"] / engine, 3) if engine else None,
        "vllm": {k: round(v, 2) for k, v in delta.items()},
        "load": os.getloadavg(),
        "task": args.task,
        "tool_choice": args.tool_choice,
    }


async def main(args: argparse.Namespace) -> None:
    key = args.key or _vllm_key()
    all_prompts = task_prompts(args.task, args.tool_choice)
    served, rest = all_prompts[: args.served], all_prompts[args.served :]
    prompts = itertools.cycle(rest)
    async with aiohttp.ClientSession() as session:
        lengths = await served_lengths(session, args.vllm_url, key, served)
        auto = auto_max_tokens(lengths, 64, SamplingConfig().max_tokens_cap)
        max_tokens = auto if args.max_tokens == "auto" else int(args.max_tokens)
        print(f"served lengths: p50 {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}")
        print(f"max_tokens: {max_tokens} ({args.max_tokens}; auto would be {auto})")
        results = []
        for concurrency in args.concurrency:
            result = await level(session, args, key, prompts, concurrency, max_tokens)
            results.append(result)
            print(json.dumps(result))
    print(f"{'c':>3} {'groups/min':>10} {'s/group':>8} {'tok/group':>9} {'prefill':>8}")
    for r in results:
        share = "-" if r["prefill_share"] is None else f"{r['prefill_share']:.0%}"
        print(
            f"{r['concurrency']:>3} {r['groups_per_min']:>10} {r['mean_group_s']:>8} "
            f"{r['tokens_per_group']:>9} {share:>8}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"judge_sampling_{args.task}_{args.tool_choice}_{args.max_tokens}.json"
    path.write_text(json.dumps({"lengths": lengths, "results": results}, indent=1))
    print(f"results: {path}")


def _vllm_key() -> str:
    from ratchet.secrets import vllm_api_key

    return vllm_api_key(load_settings(None))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-url", default="http://127.0.0.1:8401")
    parser.add_argument("--key", default="", help="vLLM's API key (default: Ratchet's own)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="per concurrency level")
    parser.add_argument("--served", type=int, default=32, help="prompts answered for lengths")
    parser.add_argument("--max-tokens", default="auto", help="a number, or auto")
    parser.add_argument("--task", default="demo", help="a bundled task (tasks)")
    parser.add_argument(
        "--tool-choice",
        choices=("as-sent", "auto", "none"),
        default="as-sent",
        help="a tool task's tool_choice: the task's own, auto, or no tools",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
