"""How long the log worker's ``bounded()`` (proxy/log/exchange.py) takes to cut a record down to
``proxy.max_record_bytes``, on the shapes that cost it most: many tiny values, many short
strings, one long string beside them. In one process, median of ``--runs``; with ``--before
<commit>``, that commit's ``bounded()`` too (read with ``git show``), on the same records::

    .venv/bin/python bench/record_cut.py [--before 6e7cb1f~1] [--runs 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.log.exchange import bounded
from ratchet.records import TrafficRecord
from tests.records import build_traffic_record

KiB = 1024
USER_HI = {"role": "user", "content": "hi"}
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "130k {} in a list, 64 KiB": ({"messages": [USER_HI], "tools": [{}] * 130_000}, 64 * KiB),
    "130k {} in a list, 900 KiB (fits)": (
        {"messages": [USER_HI], "tools": [{}] * 130_000},
        900 * KiB,
    ),
    "130k short messages (3.9 MB), 900 KiB": (
        {"messages": [{"role": "user", "content": "x"}] * 130_000},
        900 * KiB,
    ),
    "a 4 MB prompt and 130k {}, 900 KiB": (
        {"messages": [{"role": "user", "content": "y" * 4_000_000}], "tools": [{}] * 130_000},
        900 * KiB,
    ),
}

Bound = Callable[[TrafficRecord, int], bytes]


def bounded_at(commit: str) -> Bound:
    source = subprocess.run(
        ["git", "show", f"{commit}:proxy/log/exchange.py"], check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "exchange_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("exchange_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["exchange_before"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    before: Bound = module.bounded
    return before


def median_ms(bound: Bound, record: TrafficRecord, limit: int, runs: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        size = len(bound(record, limit))
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a commit whose bounded() to time as well")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    bounds: dict[str, Bound] = {"now": bounded}
    if args.before:
        bounds = {args.before: bounded_at(args.before), **bounds}
    for name, (request, limit) in CASES.items():
        record = build_traffic_record(request=request)
        timed = [(label, *median_ms(b, record, limit, args.runs)) for label, b in bounds.items()]
        print(name + ": " + "; ".join(f"{lb} {ms:.0f} ms ({size} B)" for lb, ms, size in timed))


if __name__ == "__main__":
    main()
