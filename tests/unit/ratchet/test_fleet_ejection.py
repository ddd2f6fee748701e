"""Outlier ejection (ratchet/ejection.py): consecutive failures eject a replica for a time that
grows with each ejection and is capped, a bounded share of the fleet at once, never the last."""

from __future__ import annotations

from ratchet.ejection import EjectionPolicy, Outliers

FLEET = ["http://a:8000", "http://b:8000", "http://c:8000", "http://d:8000"]
A, B, C = FLEET[:3]


def fail(outliers: Outliers, url: str, times: int, now: float, fleet: list[str] = FLEET) -> bool:
    return any([outliers.failed(url, fleet, now) for _ in range(times)])


def test_consecutive_failures_eject_and_a_success_between_them_resets_the_run() -> None:
    outliers = Outliers(EjectionPolicy(consecutive_failures=3))
    assert not fail(outliers, A, 2, now=0.0)
    outliers.succeeded(A, now=0.0)
    assert not fail(outliers, A, 2, now=1.0)  # 2 again, not 4
    assert not outliers.is_ejected(A, 1.0)
    assert outliers.failed(A, FLEET, 1.0)  # the third in a row
    assert outliers.is_ejected(A, 1.0) and outliers.ejected(FLEET, 2.0) == [A]
    assert not outliers.is_ejected(B, 1.0)


def test_the_ejection_grows_with_each_one_and_is_capped() -> None:
    policy = EjectionPolicy(consecutive_failures=1, base_s=30.0, max_s=100.0)
    outliers = Outliers(policy)
    now, lengths = 0.0, []
    for _ in range(5):
        assert outliers.failed(A, FLEET, now)
        until = outliers.replicas[A].ejected_until
        lengths.append(until - now)
        now = until + 1.0  # back, and failing again at once
    assert lengths == [30.0, 60.0, 90.0, 100.0, 100.0]
    assert outliers.replicas[A].ejections == 5


def test_time_in_service_takes_the_multiplier_down() -> None:
    policy = EjectionPolicy(consecutive_failures=1, base_s=10.0, max_s=50.0)
    outliers = Outliers(policy)
    for now in (0.0, 20.0, 60.0):  # ejected 10, 20, 30 s, failing as each ends
        assert outliers.failed(A, FLEET, now)
    assert outliers.replicas[A].ejected_until == 90.0
    outliers.succeeded(A, now=91.0)
    # 2 * max_s in service: two off the multiplier (3 -> 1), then this ejection's +1.
    assert fail(outliers, A, 1, now=190.0)
    assert outliers.replicas[A].ejected_until == 190.0 + 20.0


def test_a_replica_back_from_ejection_is_out_again_at_its_first_failure_until_it_answers() -> None:
    outliers = Outliers(EjectionPolicy(consecutive_failures=5, base_s=10.0))
    assert fail(outliers, A, 5, now=0.0)
    assert outliers.failed(A, FLEET, 11.0)  # probation: one failure is enough
    outliers.succeeded(A, now=40.0)  # ejected 20 s from 11: back at 31, and it answered
    assert not fail(outliers, A, 4, now=41.0)
    assert outliers.failed(A, FLEET, 41.0)  # five in a row again


def test_an_answer_to_a_request_sent_before_the_ejection_does_not_end_probation() -> None:
    outliers = Outliers(EjectionPolicy(consecutive_failures=2, base_s=10.0))
    assert fail(outliers, A, 2, now=0.0)
    outliers.succeeded(A, now=5.0)  # still out: an old request's answer
    assert not outliers.failed(A, FLEET, 6.0)  # failures while out do not count either
    assert outliers.failed(A, FLEET, 11.0)  # back at 10, still on probation


def test_at_most_max_percent_of_the_fleet_is_out_at_once_and_never_the_last() -> None:
    outliers = Outliers(EjectionPolicy(consecutive_failures=1, max_percent=50.0))
    assert fail(outliers, A, 1, now=0.0) and fail(outliers, B, 1, now=0.0)
    assert not fail(outliers, C, 3, now=0.0)  # 2 of 4 out: C stays in, still counted
    assert outliers.replicas[C].consecutive == 3
    assert fail(outliers, C, 1, now=31.0)  # A and B are back: C goes at its next failure
    assert outliers.ejected(FLEET, 31.0) == [C]

    # At least one may go, whatever the share; never the last.
    assert EjectionPolicy(max_percent=10.0).allowed(4) == 1
    assert EjectionPolicy(max_percent=100.0).allowed(3) == 2
    lone = Outliers(EjectionPolicy(consecutive_failures=1, max_percent=100.0))
    assert not fail(lone, A, 10, now=0.0, fleet=[A])
    pair = Outliers(EjectionPolicy(consecutive_failures=1, max_percent=100.0))
    assert fail(pair, A, 1, now=0.0, fleet=[A, B])
    assert not fail(pair, B, 5, now=0.0, fleet=[A, B])


def test_ejection_off_counts_but_never_ejects_and_leavers_are_forgotten() -> None:
    outliers = Outliers(EjectionPolicy(consecutive_failures=0))
    assert not fail(outliers, A, 50, now=0.0)
    assert outliers.replicas[A].consecutive == 50 and outliers.ejected(FLEET, 0.0) == []
    outliers.forget([B, C])
    assert A not in outliers.replicas
