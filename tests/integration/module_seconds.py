"""Each integration module's measured seconds, for scheduling the lane (conftest.py): the
longest first, split between the workers by longest-processing-time.

`scripts/test` keeps every test's time in .ratchet/test-times/integration.xml (JUnit). After a
full run on the CI host, refresh the table from it:

    .venv/bin/python -m tests.integration.module_seconds .ratchet/test-times/integration.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("module_seconds.json")
# A module the table does not know yet (new since the last refresh): short, so it fills in.
UNKNOWN_S = 60.0


def load() -> dict[str, float]:
    """Module file name -> seconds."""
    table: dict[str, float] = json.loads(TABLE.read_text())
    return table


def from_junit(path: Path) -> dict[str, float]:
    """Module file name -> the sum of its tests' times (setup and teardown included) in a JUnit
    report of the integration lane."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is tests.integration.test_x (or ...test_x.Class for a method)
        name = next((part for part in module if part.startswith("test_")), None)
        if name is not None:
            seconds[f"{name}.py"] += float(case.get("time", "0"))
    return dict(seconds)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m tests.integration.module_seconds JUNIT_XML ({__doc__})")
    # Modules the report does not hold (a run of a few) keep their figures. The first module on
    # each worker also carries the wait for its stack's boot.
    merged = {**load(), **{name: round(s) for name, s in from_junit(Path(argv[0])).items()}}
    table = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
    TABLE.write_text(json.dumps(table, indent=2) + "\n")
    print(f"{TABLE}: {len(table)} modules, {sum(table.values())} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
