"""How fast, and on how many cores, does the embedded vLLM answer with and without the
``ratchet_cpu_yield`` plugin (embedded/vllm_cpu_yield.py)?

Run it from the repository root (starts its own vLLMs on free ports, one after the other)::

    .venv/bin/python bench/vllm_cpu_yield.py [--groups 4] [--group-size 4] [--concurrency 4]

Method
------
The embedded stack's vLLM (``embedded.stack.vllm_part``) is started alone twice: first with
``ratchet_cpu_yield`` left out of ``VLLM_PLUGINS`` (the peer: vLLM's own 1 s busy-wait), then as
the stack runs it. Each, after a warm-up, runs two workloads:

* ``groups``: the same seeded groups as the judge samples (``sample_all`` of
  bench/vllm_block_size.py), over the first ``--groups`` prompts of every bundled task,
  ``--concurrency`` groups at a time. The seeds make both runs generate the same tokens: the
  counts must agree.
* ``single``: the first ``--single`` of those prompts, one answer each, one request at a time
  (the same seeded sampling), as one user's chat or one of the gate's calls at a time. A plugin
  that slows vLLM's hand-over between its processes shows here first: a step is short and
  nothing else overlaps it (the plugin's first version made these 20x slower while the groups
  ran as fast).

Printed per run and workload: seconds, generated tokens per second (from vLLM's ``/metrics``),
and the cores vLLM's processes used meanwhile (their user + system CPU seconds over the wall
seconds, read with psutil), each with its ratio against the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.judge_sampling import vllm_metrics  # noqa: E402
from bench.vllm_block_size import lone_vllm, sample_all  # noqa: E402
from embedded.processes import Part  # noqa: E402
from embedded.vllm_cpu_yield import PLUGIN_NAME  # noqa: E402
from tasks import TASKS  # noqa: E402


def cpu_seconds(root: psutil.Process) -> float:
    """User + system CPU seconds of `root` and every process under it (vLLM's engine and
    worker are its children)."""
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def measure(with_yield: bool, prompts: list[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    def plugins(part: Part) -> None:
        if not with_yield:
            names = part.env["VLLM_PLUGINS"].split(",")
            part.env["VLLM_PLUGINS"] = ",".join(n for n in names if n != PLUGIN_NAME)

    one_at_a_time = argparse.Namespace(**{**vars(args), "concurrency": 1})
    with lone_vllm(plugins) as (url, key, part):
        assert part.process is not None
        root = psutil.Process(part.process.pid)
        asyncio.run(sample_all(url, key, prompts[:2], args, args.group_size))  # warm-up
        workloads = {
            "groups": lambda: asyncio.run(sample_all(url, key, prompts, args, args.group_size)),
            "single": lambda: asyncio.run(
                sample_all(url, key, prompts[: args.single], one_at_a_time, 1)
            ),
        }
        return [
            {"ratchet_cpu_yield": with_yield, "workload": name, **timed(url, root, run)}
            for name, run in workloads.items()
        ]


def timed(url: str, root: psutil.Process, run: Callable[[], object]) -> dict[str, Any]:
    """Seconds, tokens generated, tokens per second and cores of vLLM's processes over `run`."""
    before_tokens = vllm_metrics(url)["generation_tokens"]
    before_cpu = cpu_seconds(root)
    started = time.monotonic()
    run()
    seconds = time.monotonic() - started
    cpu = cpu_seconds(root) - before_cpu
    tokens = vllm_metrics(url)["generation_tokens"] - before_tokens
    return {
        "seconds": round(seconds, 1),
        "generation_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "cores": round(cpu / seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--groups", type=int, default=4, help="prompts per task")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=8, help="prompts answered one by one")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "vllm_cpu_yield.json"
    )
    args = parser.parse_args()
    prompts = [p["messages"] for task in TASKS.values() for p in task.load_prompts()[: args.groups]]
    peer, ours = (measure(with_yield, prompts, args) for with_yield in (False, True))
    print(
        f"{'vLLM':>22} {'workload':>8} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'x peer':>7}"
        f" {'cores':>6} {'x peer':>7}"
    )
    for label, rows in (("own busy-wait (peer)", peer), (f"with {PLUGIN_NAME}", ours)):
        for r, p in zip(rows, peer, strict=True):
            print(
                f"{label:>22} {r['workload']:>8} {r['seconds']:>8} {r['generation_tokens']:>7.0f}"
                f" {r['tokens_per_s']:>9} {r['tokens_per_s'] / p['tokens_per_s']:>6.2f}x"
                f" {r['cores']:>6} {r['cores'] / p['cores']:>6.2f}x"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(peer + ours, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
