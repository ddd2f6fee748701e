"""How many cores does the embedded vLLM take to sample the judge's groups, with and without the
``ratchet_cpu_yield`` plugin (ratchet/dev/vllm_cpu_yield.py)?

Run it from the repository root (starts its own vLLMs on free ports, one after the other)::

    .venv/bin/python bench/vllm_cpu_yield.py [--groups 4] [--group-size 4] [--concurrency 4]

Method
------
The embedded stack's vLLM (``ratchet.dev.stack.vllm_part``) is started alone twice: first with
``ratchet_cpu_yield`` left out of ``VLLM_PLUGINS`` (the peer: vLLM's own 1 s busy-wait), then as
the stack runs it. Each samples the same seeded groups as the judge does (``sample_all`` of
bench/vllm_block_size.py) over the first ``--groups`` prompts of every bundled task, after a
warm-up. Printed per run: seconds, generated tokens per second (from vLLM's ``/metrics``), and
the cores vLLM's processes used meanwhile (their user + system CPU seconds over the wall
seconds, read with psutil), each with its ratio against the peer. The seeds make both runs
generate the same tokens: the counts must agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.judge_sampling import vllm_metrics  # noqa: E402
from bench.vllm_block_size import SERVED_MODEL, sample_all  # noqa: E402
from ratchet.dev.model import prepare_model  # noqa: E402
from ratchet.dev.processes import Stack, free_port  # noqa: E402
from ratchet.dev.stack import vllm_part  # noqa: E402
from ratchet.dev.vllm_cpu_yield import PLUGIN_NAME  # noqa: E402
from ratchet.secrets import vllm_api_key  # noqa: E402
from ratchet.settings import RatchetSettings, default_home  # noqa: E402
from ratchet.tasks import TASKS  # noqa: E402


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


def measure(with_yield: bool, prompts: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ratchet-yield-") as tmp:
        settings = RatchetSettings(vllm_url=f"http://127.0.0.1:{free_port()}", home=Path(tmp))
        part = vllm_part(settings, prepare_model(default_home(), quiet=True), SERVED_MODEL)
        if not with_yield:
            plugins = part.env["VLLM_PLUGINS"].split(",")
            part.env["VLLM_PLUGINS"] = ",".join(p for p in plugins if p != PLUGIN_NAME)
        stack = Stack([part], Path(tmp) / "state")
        stack.start()
        try:
            assert part.process is not None
            root = psutil.Process(part.process.pid)
            url, key = settings.vllm_url, vllm_api_key(settings)
            asyncio.run(sample_all(url, key, prompts[:2], args, args.group_size))  # warm-up
            before_tokens = vllm_metrics(url)["generation_tokens"]
            before_cpu = cpu_seconds(root)
            seconds = asyncio.run(sample_all(url, key, prompts, args, args.group_size))
            cpu = cpu_seconds(root) - before_cpu
            tokens = vllm_metrics(url)["generation_tokens"] - before_tokens
        finally:
            stack.stop()
    return {
        "ratchet_cpu_yield": with_yield,
        "groups": len(prompts),
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
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "vllm_cpu_yield.json"
    )
    args = parser.parse_args()
    prompts = [p["messages"] for task in TASKS.values() for p in task.load_prompts()[: args.groups]]
    peer, ours = (measure(with_yield, prompts, args) for with_yield in (False, True))
    print(
        f"{'vLLM':>22} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'x peer':>7}"
        f" {'cores':>6} {'x peer':>7}"
    )
    for label, r in (("own busy-wait (peer)", peer), (f"with {PLUGIN_NAME}", ours)):
        print(
            f"{label:>22} {r['seconds']:>8} {r['generation_tokens']:>7.0f} {r['tokens_per_s']:>9}"
            f" {r['tokens_per_s'] / peer['tokens_per_s']:>6.2f}x {r['cores']:>6}"
            f" {r['cores'] / peer['cores']:>6.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([peer, ours], indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
