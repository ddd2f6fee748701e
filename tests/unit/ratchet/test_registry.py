"""ratchet.registry.AliasRoute: arm choice, sticky cohorts (keyed with the server secret and the
caller's API key, so a client can neither choose nor predict its arm), hash round trip, served
names."""

from __future__ import annotations

import hashlib
import logging
import math
import random
from dataclasses import replace
from typing import Any

import pytest

from ratchet.registry import (
    AliasRoute,
    InvalidRoute,
    InvalidRoutes,
    RoutingTable,
    alias_key,
    history_key,
    served_name,
)
from ratchet.settings import AliasConfig

KEYS = [f"user-{i}" for i in range(20_000)]
SECRET = b"the server secret"
KEY_A = "hmac-sha256:" + "a" * 64  # the caller's API key hash


def route(**fields: Any) -> AliasRoute:
    base: dict[str, Any] = dict(alias="support", base_model="smollm2-135m-instruct", active=3)
    base.update(fields)
    return AliasRoute(**base)


def pick(
    r: AliasRoute, sticky: str | None, key_hash: str | None = KEY_A, secret: bytes = SECRET
) -> tuple[int, str]:
    return r.pick(sticky, key_hash=key_hash, secret=secret)


def cohort(
    r: AliasRoute, key_hash: str | None = KEY_A, secret: bytes = SECRET, keys: list[str] = KEYS
) -> set[str]:
    """The sticky values that land on the canary."""
    return {k for k in keys if pick(r, k, key_hash, secret)[1] == "canary"}


def test_no_canary_always_active() -> None:
    r = route()
    assert pick(r, None) == (3, "active")
    assert all(pick(r, k) == (3, "active") for k in KEYS[:500])


def test_zero_weight_canary_always_active() -> None:
    r = route(canary=4, canary_weight=0.0)
    assert all(pick(r, k) == (3, "active") for k in KEYS[:500])
    assert all(pick(r, None) == (3, "active") for _ in range(200))


def test_full_weight_canary_always_canary() -> None:
    r = route(canary=4, canary_weight=1.0)
    assert all(pick(r, k) == (4, "canary") for k in KEYS[:500])
    assert all(pick(r, None) == (4, "canary") for _ in range(200))


def test_sticky_key_gives_the_same_arm() -> None:
    r = route(canary=4, canary_weight=0.5)
    for key in KEYS[:300]:
        first = pick(r, key)
        assert first in ((3, "active"), (4, "canary"))
        assert all(pick(r, key) == first for _ in range(5))
    # A fresh but equal route object (another proxy replica) agrees.
    twin = route(canary=4, canary_weight=0.5)
    assert [pick(twin, k) for k in KEYS[:300]] == [pick(r, k) for k in KEYS[:300]]


def _within(count: int, n: int, p: float, sigmas: float = 3.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_canary_share_matches_weight() -> None:
    r = route(canary=4, canary_weight=0.2)
    canary = sum(1 for k in KEYS if pick(r, k)[1] == "canary")
    assert _within(canary, len(KEYS), 0.2), canary


def test_canary_share_without_sticky_key() -> None:
    random.seed(1234)
    r = route(canary=4, canary_weight=0.2)
    canary = sum(1 for _ in range(20_000) if pick(r, None)[1] == "canary")
    assert _within(canary, 20_000, 0.2), canary


def test_raising_weight_only_adds_users_to_the_canary() -> None:
    """Ramping a canary up keeps everyone already on it there (same hash, larger threshold)."""
    low = route(canary=4, canary_weight=0.1)
    high = route(canary=4, canary_weight=0.3)
    low_cohort = {k for k in KEYS if pick(low, k)[1] == "canary"}
    high_cohort = {k for k in KEYS if pick(high, k)[1] == "canary"}
    assert low_cohort < high_cohort


def test_new_canary_version_reshuffles_cohort() -> None:
    v4 = route(canary=4, canary_weight=0.2)
    v5 = route(canary=5, canary_weight=0.2)
    cohort4 = {k for k in KEYS if pick(v4, k)[1] == "canary"}
    cohort5 = {k for k in KEYS if pick(v5, k)[1] == "canary"}
    n = len(KEYS)
    assert _within(len(cohort5), n, 0.2)
    # Independent draws: the overlap is about 0.2 * 0.2 of users, not 0.2.
    overlap = len(cohort4 & cohort5)
    assert _within(overlap, n, 0.04), overlap


def test_cohort_depends_on_alias() -> None:
    a = route(canary=4, canary_weight=0.2)
    b = route(alias="billing", canary=4, canary_weight=0.2)
    cohort_a = {k for k in KEYS if pick(a, k)[1] == "canary"}
    cohort_b = {k for k in KEYS if pick(b, k)[1] == "canary"}
    assert _within(len(cohort_a & cohort_b), len(KEYS), 0.04)


def test_a_client_cannot_predict_its_arm_without_the_secret() -> None:
    """The arm of a sticky value is a keyed hash under the server secret: under another secret
    (all a client can guess) the cohort is drawn afresh, so knowing which values land on the
    canary under one secret says nothing about another."""
    r = route(canary=4, canary_weight=0.2)
    ours = cohort(r)
    guessed = cohort(r, secret=b"a guess at the secret")
    n = len(KEYS)
    assert _within(len(ours), n, 0.2) and _within(len(guessed), n, 0.2)
    assert _within(len(ours & guessed), n, 0.04), len(ours & guessed)
    # Nor by the unkeyed hash of the sticky value that chose the arm before.
    unkeyed = {
        k
        for k in KEYS
        if int.from_bytes(
            hashlib.blake2b(f"support\0{4}\0{k}".encode(), digest_size=8).digest(), "big"
        )
        / 2**64
        < 0.2
    }
    assert _within(len(ours & unkeyed), n, 0.04), len(ours & unkeyed)


def test_the_same_sticky_value_under_two_keys_is_drawn_independently() -> None:
    """Two API keys sending the same user id do not share an arm: one client cannot learn (or
    pick) another's arm by copying its sticky value."""
    r = route(canary=4, canary_weight=0.5)
    other = "hmac-sha256:" + "b" * 64
    agree = sum(1 for k in KEYS if pick(r, k) == pick(r, k, key_hash=other))
    # Independent draws agree on half of the values at weight 0.5, not on all of them.
    assert _within(agree, len(KEYS), 0.5), agree
    # Without auth every caller has no key hash: stickiness still holds per value.
    assert all(pick(r, k, key_hash=None) == pick(r, k, key_hash=None) for k in KEYS[:200])


def test_on_canary() -> None:
    assert not route().on_canary
    assert not route(canary=4, canary_weight=0.0).on_canary
    assert route(canary=4, canary_weight=0.1).on_canary


@pytest.mark.parametrize(
    "r",
    [
        route(),
        route(canary=4, canary_weight=0.2, paused=True, updated_at="2024-05-01T00:00:00.000Z"),
        route(active=0, canary=1, canary_weight=0.1 + 0.2, updated_at="2024-05-01T00:00:00Z"),
        route(alias="x.y_z-1", base_model="other", active=17, updated_at="t"),
    ],
)
def test_hash_round_trip(r: AliasRoute) -> None:
    data = r.to_hash()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in data.items())
    assert set(data) == {"active", "canary", "canary_weight", "base_model", "paused", "updated_at"}
    aliases = {
        r.alias: AliasConfig(base_model="fallback-base"),
        "b": AliasConfig(base_model="other"),
    }
    aliases["c"] = AliasConfig(base_model="smollm2-135m-instruct")
    back = AliasRoute.from_hash(r.alias, data, aliases)
    if r.updated_at is None:
        assert back.updated_at  # to_hash stamps a time
        assert replace(back, updated_at=None) == r
    else:
        assert back == r


def test_hash_as_redis_returns_it() -> None:
    """Redis answers bytes; the cache decodes them, and empty fields mean defaults."""
    aliases = {"support": AliasConfig(base_model="base-m")}
    back = AliasRoute.from_hash("support", {"active": "2", "canary": ""}, aliases)
    assert back == AliasRoute(alias="support", base_model="base-m", active=2)
    assert back.canary is None and back.canary_weight == 0.0 and back.paused is False
    assert AliasRoute.from_hash("support", {}, aliases).active == 0


def test_served_name() -> None:
    assert served_name("support", 0, "smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_name("support", 1, "smollm2-135m-instruct") == "support@v1"
    assert served_name("support", 12, "smollm2-135m-instruct") == "support@v12"


def test_redis_keys() -> None:
    assert alias_key("support") == "ratchet:alias:support"
    assert history_key("support") == "ratchet:alias:support:history"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("active", "three"),
        ("active", "-1"),
        ("canary", "1.5"),
        ("canary_weight", "lots"),
        ("canary_weight", "nan"),
        ("canary_weight", "1.01"),
        ("canary_weight", "-0.2"),
    ],
)
def test_an_invalid_field_is_refused_by_name(field: str, value: str) -> None:
    data = {**route(canary=4, canary_weight=0.2).to_hash(), field: value}
    with pytest.raises(InvalidRoute) as refused:
        AliasRoute.from_hash("support", data, {"support": AliasConfig()})
    assert f"ratchet:alias:support: {field} is {value!r}" in str(refused.value)


# What a hand-written hash could make vLLM's filesystem resolver load as "v0".
FOREIGN_BASES = ["../x", "/etc/lora", "..", "other-model", "base-m/../x", "BASE-M", "base-m "]


@pytest.mark.parametrize("base", FOREIGN_BASES)
def test_a_base_model_not_in_the_config_is_refused(base: str) -> None:
    aliases = {"support": AliasConfig(base_model="base-m")}
    with pytest.raises(InvalidRoute) as refused:
        AliasRoute.from_hash("support", {"active": "0", "base_model": base}, aliases)
    assert "ratchet:alias:support: base_model is" in str(refused.value)
    assert "ratchet.yaml" in str(refused.value)


def test_a_base_model_of_another_configured_alias_is_served() -> None:
    aliases = {"support": AliasConfig(base_model="a"), "sales": AliasConfig(base_model="b")}
    route = AliasRoute.from_hash("support", {"active": "0", "base_model": "b"}, aliases)
    assert served_name("support", 0, route.base_model) == "b"
    # An alias only Redis knows routes only on a configured base model.
    assert AliasRoute.from_hash("new", {"base_model": "a"}, aliases).base_model == "a"
    with pytest.raises(InvalidRoute):
        AliasRoute.from_hash("new", {"active": "1"}, aliases)  # no base model at all


def test_a_foreign_base_model_keeps_the_last_route_and_is_listed() -> None:
    aliases = {"support": AliasConfig(base_model="base-m")}
    last = route(alias="support", base_model="base-m", active=0)
    hashes = {
        "support": {"active": "0", "base_model": "../../adapters/x"},
        "new": {"base_model": "/x"},
    }
    table = RoutingTable.build(hashes, aliases, previous={"support": last})
    assert table.routes["support"] == last
    assert "new" not in table.routes
    assert set(table.invalid) == {"support", "new"}


def test_one_invalid_hash_keeps_its_last_route_and_costs_the_others_nothing() -> None:
    aliases = {"support": AliasConfig(base_model="base-m")}
    hashes = {
        "support": {"active": "x"},
        "sales": {"active": "2", "base_model": "base-m"},
        "new": {"canary_weight": "nope"},
    }
    last = route(alias="support", active=3)
    table = RoutingTable.build(hashes, aliases, previous={"support": last})
    assert table.routes["support"] == last  # kept, not reset to v0
    assert table.routes["sales"].active == 2
    assert "new" not in table.routes  # no valid route ever seen: not routed
    assert set(table.invalid) == {"support", "new"}
    # Without a last route, a configured alias falls back to its ratchet.yaml default.
    assert RoutingTable.build(hashes, aliases).routes["support"].active == 0


def test_an_invalid_route_is_logged_once_until_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    invalid = InvalidRoutes()
    with caplog.at_level(logging.INFO, logger="ratchet.registry"):
        assert invalid.update({"a": "why"}) == ["a"]
        assert invalid.update({"a": "why"}) == []
        assert invalid.update({"a": "another"}) == ["a"]
        assert invalid.update({}) == []
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "valid again" in messages[-1], messages
