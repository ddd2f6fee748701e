"""The overview's throughput: counters read from a metrics page, and their increase over a
window of samples (a restarted service's counter starting again from zero)."""

from __future__ import annotations

from collections import deque

import pytest

from console.stats import Counts, counts_of, increase

PAGE = """# HELP ratchet_proxy_requests_total Requests
# TYPE ratchet_proxy_requests_total counter
ratchet_proxy_requests_total{alias="a",version="0",arm="active",endpoint="chat",status="200"} 7.0
ratchet_proxy_requests_total{alias="a",version="1",arm="canary",endpoint="chat",status="200"} 3.0
ratchet_proxy_requests_total{alias="b",version="0",arm="active",endpoint="chat",status="429"} 2.0
# HELP ratchet_proxy_other_total Other
# TYPE ratchet_proxy_other_total counter
ratchet_proxy_other_total{alias="a"} 100.0
"""


def test_counters_are_summed_per_alias_over_their_other_labels() -> None:
    counts = counts_of(PAGE, {"ratchet_proxy_requests_total": "requests"})
    assert counts == {("requests", "a"): 10.0, ("requests", "b"): 2.0}


def samples(*points: tuple[float, float]) -> deque[tuple[float, Counts]]:
    return deque((t, {("requests", "a"): v}) for t, v in points)


@pytest.mark.parametrize(
    ("points", "window", "expected"),
    [
        (((0, 5), (30, 9), (60, 20)), 60, 15),  # the whole minute
        (((0, 5), (30, 9), (60, 20)), 30, 11),  # the last 30 s
        (((0, 5), (3000, 50), (3660, 70)), 3600, 20),  # older samples are outside the hour
        (((0, 50), (30, 4)), 60, 4),  # restarted: counted from zero
        (((0, 5),), 60, None),  # one sample: no increase yet
    ],
)
def test_increase_over_a_window(
    points: tuple[tuple[float, float], ...], window: float, expected: float | None
) -> None:
    assert increase(samples(*points), ("requests", "a"), window) == expected


def test_a_counter_missing_from_the_last_scrape_is_unknown() -> None:
    kept = samples((0, 5), (30, 9))
    kept.append((60, {}))  # the proxy did not answer
    assert increase(kept, ("requests", "a"), 60) is None
