"""Does the embedded vLLM's KV block size let a group's K answers share their prompt's prefill?

Run it from the repository root (starts its own vLLMs on free ports, one after the other)::

    .venv/bin/python bench/vllm_block_size.py [--blocks 128,32] [--groups 16] [--group-size 6]

Method
------
For each block size, the embedded stack's vLLM (``embedded.stack.vllm_part``, with
``--block-size`` set last so it wins) is started alone, and the same groups are sampled exactly as
the judge samples them (``judge.sampler.sampling_body`` and ``sample_group``: one request with
``n=K``, temperature 0.7, a fixed seed per group), ``--concurrency`` at a time, over the first
``--groups`` prompts of every bundled task (``tasks``). Printed per block size: groups per
minute, vLLM's prefix-cache hit rate and generated tokens (from its ``/metrics``, before and after),
and the ratio of groups per minute against the first block size given (the CPU build's default
is 128). The seeds make both runs generate the same answers: the generated token counts must
agree. Then the same prompts once each as single-answer requests (``n=1``, what served traffic
is: nothing shared), with their rate against the peer's, so a block size that helps groups is
seen not to slow serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.judge_sampling import vllm_metrics  # noqa: E402
from embedded.model import prepare_model  # noqa: E402
from embedded.processes import Part, Stack, free_port  # noqa: E402
from embedded.stack import vllm_part  # noqa: E402
from judge.sampler import sample_group, sampling_body  # noqa: E402
from ratchet.secrets import vllm_api_key  # noqa: E402
from ratchet.settings import RatchetSettings, SamplingConfig, default_home  # noqa: E402
from tasks import TASKS  # noqa: E402

SERVED_MODEL = "smollm2-135m-instruct"


async def sample_all(
    url: str, key: str, prompts: list[Any], args: argparse.Namespace, group_size: int
) -> float:
    """Seconds to sample ``group_size`` answers per prompt, ``args.concurrency`` prompts at a
    time."""
    sampling = SamplingConfig(temperature=0.7, max_tokens=args.max_tokens)
    limit = asyncio.Semaphore(args.concurrency)

    async def one(session: aiohttp.ClientSession, i: int, prompt: Any) -> None:
        body = sampling_body(SERVED_MODEL, prompt, {}, group_size, sampling, seed=i)
        async with limit:
            await sample_group(session, url, body, 600, key)

    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts)))
    return time.monotonic() - started


@contextmanager
def lone_vllm(adjust: Callable[[Part], None]) -> Iterator[tuple[str, str, Part]]:
    """The embedded stack's vLLM alone on a free port under a temporary home, changed by
    ``adjust`` before it starts: its URL, its key and its part (the process), until the block
    ends."""
    with tempfile.TemporaryDirectory(prefix="ratchet-bench-vllm-") as tmp:
        settings = RatchetSettings(vllm_url=f"http://127.0.0.1:{free_port()}", home=Path(tmp))
        part = vllm_part(settings, prepare_model(default_home(), quiet=True), SERVED_MODEL)
        adjust(part)
        stack = Stack([part], Path(tmp) / "state")
        stack.start()
        try:
            yield settings.vllm_url, vllm_api_key(settings), part
        finally:
            stack.stop()


def measure(block: int, prompts: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    def block_size_last(part: Part) -> None:
        part.command += ["--block-size", str(block)]

    with lone_vllm(block_size_last) as (url, key, _):
        # warm up: compile, first load
        asyncio.run(sample_all(url, key, prompts[:2], args, args.group_size))
        before = vllm_metrics(url)
        seconds = asyncio.run(sample_all(url, key, prompts, args, args.group_size))
        after = vllm_metrics(url)
        # Served traffic (one answer a request, nothing shared) must not pay for it.
        single = asyncio.run(sample_all(url, key, prompts, args, 1))
    delta = {k: after[k] - before[k] for k in after}
    queries = delta["prefix_queries"]
    return {
        "block_size": block,
        "groups": len(prompts),
        "seconds": round(seconds, 1),
        "groups_per_min": round(len(prompts) * 60 / seconds, 2),
        "single_answers_per_min": round(len(prompts) * 60 / single, 1),
        "prefix_hit_rate": round(delta["prefix_hits"] / queries, 3) if queries else None,
        "prompt_tokens": delta["prompt_tokens"],
        "generation_tokens": delta["generation_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--blocks", default="128,32", help="block sizes; the first is the peer")
    parser.add_argument("--groups", type=int, default=16, help="prompts per task")
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_blocks.json")
    args = parser.parse_args()
    prompts = [p["messages"] for task in TASKS.values() for p in task.load_prompts()[: args.groups]]
    results = [measure(int(b), prompts, args) for b in args.blocks.split(",")]
    peer, peer_single = results[0]["groups_per_min"], results[0]["single_answers_per_min"]
    print(
        f"{'block':>6} {'groups/min':>11} {'x peer':>7} {'prefix hits':>12} {'gen tokens':>11}"
        f" {'1-answer req/min':>17} {'x peer':>7}"
    )
    for r in results:
        hits = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.0%}"
        single = r["single_answers_per_min"]
        print(
            f"{r['block_size']:>6} {r['groups_per_min']:>11} {r['groups_per_min'] / peer:>6.2f}x "
            f"{hits:>12} {r['generation_tokens']:>11.0f} {single:>17} {single / peer_single:>6.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
