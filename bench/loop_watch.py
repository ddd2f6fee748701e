"""What the loop is doing while bench/loop_speed.py drives it: the alias's route and lifecycle
history (Redis), the judge's and learner's /metrics, and the learner's resident memory (/proc)."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from embedded.processes import Stack
from ratchet.registry import RegistryWriter
from ratchet.secrets import redis_connection_url
from ratchet.settings import RatchetSettings

POLL_S = 2.0


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return []
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def proc_memory(pid: int | None) -> tuple[int, int]:
    """(resident, peak resident) bytes of ``pid`` from /proc; zeros when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text() if pid else ""
    except OSError:
        return 0, 0
    found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.MULTILINE))
    return int(found.get("VmRSS", 0)) * 1024, int(found.get("VmHWM", 0)) * 1024


@dataclass
class Watch:
    """What the watcher saw, every POLL_S seconds, since traffic began."""

    timeline: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    first_promotion_s: float | None = None
    promoted: int | None = None
    peak_rss: int = 0

    def last(self, key: str, default: float = 0.0) -> float:
        return float(self.timeline[-1][key]) if self.timeline else default


class Watcher:
    def __init__(self, settings: RatchetSettings, alias: str, stack: Stack) -> None:
        self.alias, self.stack = alias, stack
        self.registry = RegistryWriter(redis_connection_url(settings), settings.aliases)
        self.judge_url = f"http://127.0.0.1:{settings.judge.metrics_port}/metrics"
        self.learner_url = f"http://127.0.0.1:{settings.learner.metrics_port}/metrics"
        self.watch = Watch()
        self.seen: set[str] = set()
        self.started = time.monotonic()
        self.promoted = threading.Event()
        self.traffic: dict[str, int] = {}  # the traffic's live counts, when it shares them

    def poll(self) -> None:
        t = time.monotonic() - self.started
        route = self.registry.read(self.alias)
        active = route.active if route is not None else 0
        for event in reversed(self.registry.history(self.alias, limit=100)):
            key = json.dumps(event, sort_keys=True, default=str)
            if key not in self.seen:
                self.seen.add(key)
                self.watch.events.append({**event, "bench_s": round(t, 1)})
        judge, learner = scrape(self.judge_url), scrape(self.learner_url)
        process = self.stack.part("learner").process
        rss, peak = proc_memory(process.pid if process else None)
        rss = int(metric(learner, "process_resident_memory_bytes")) or rss
        self.watch.peak_rss = max(self.watch.peak_rss, peak, rss)
        a = {"alias": self.alias}
        self.watch.timeline.append(
            {
                "t": round(t, 1),
                "active": active,
                "groups": metric(judge, "ratchet_judge_groups_total", **a),
                "heldout": metric(judge, "ratchet_judge_heldout_total", **a),
                # GRPO learns only from groups whose rewards differ
                "zero_spread": metric(judge, "ratchet_judge_zero_variance_total", **a),
                "reward_sum": metric(judge, "ratchet_judge_reward_sum", **a),
                "rewards": metric(judge, "ratchet_judge_reward_count", **a),
                "rounds": metric(learner, "ratchet_learner_rounds_total", **a),
                "rejected": metric(learner, "ratchet_learner_rounds_total", result="rejected", **a),
                "trained_tokens": metric(learner, "ratchet_learner_trained_tokens_total", **a),
                "train_s": metric(learner, "ratchet_learner_round_seconds_sum", phase="train", **a),
                "rss": rss,
                "answered": self.traffic.get("answered", 0),
            }
        )
        if active and self.watch.first_promotion_s is None:
            self.watch.first_promotion_s, self.watch.promoted = t, active
            self.promoted.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a watcher that dies would end the run blind
                print(f"watcher: {exc!r}", file=sys.stderr)
            stop.wait(POLL_S)
