"""Write the demo task's prompt set, ``tasks/demo/prompts.jsonl``, from the seeded generator.

Re-running gives the same file byte for byte (``tests/unit/test_demo.py`` checks the shipped one)::

    .venv/bin/python scripts/make_demo_prompts.py [--out PATH] [--count N] [--seed S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.demo import DEFAULT_COUNT, DEFAULT_SEED, PROMPTS_FILE, prompts_jsonl  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the demo task's prompt set.")
    parser.add_argument("--out", type=Path, default=ROOT / "tasks" / "demo" / PROMPTS_FILE)
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    text = prompts_jsonl(args.count, args.seed)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.count} prompts to {args.out}")


if __name__ == "__main__":
    main()
