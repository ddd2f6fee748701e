"""Excluded replicas asked again: a replica out of a routed version's rotation because its vLLM
could not load the version (learner/served_check.py, ratchet/version_exclusion.py) may load it
now (it restarted with the store in view, or a new pod took its address). The canary watcher
calls :func:`reprobe` on its tick, at most every ``learner.served_check.reprobe_s``: each
excluded replica answers the version's probe once, and one that serves it as trained is taken
back (its exclusion deleted, published, so ``ratchet_fleet_version_excluded`` drops it). One
that still cannot load it, serves other weights or cannot be reached stays out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import redis

from learner.drift import FINGERPRINT_KEY
from learner.fingerprint import Fingerprint
from learner.served_check import ServedCheck
from ratchet.registry import AliasRoute, served_name
from ratchet.secrets import vllm_api_key
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore
from ratchet.version_exclusion import read_versions, readmit, routed_versions

log = logging.getLogger(__name__)


def fingerprint_of(store: AdapterStore, alias: str, version: int) -> Fingerprint | None:
    """The version's fingerprint from its store metadata; None without one (imported)."""
    try:
        return Fingerprint.from_dict(store.meta(alias, version).get(FINGERPRINT_KEY))
    except (OSError, ValueError):
        return None


def reprobe(
    settings: RatchetSettings,
    client: redis.Redis,
    store: AdapterStore,
    routes: Iterable[AliasRoute],
) -> dict[tuple[str, int], list[str]]:
    """Ask every excluded replica of every routed version once; readmit those that match.
    Returns what was readmitted, per (alias, version)."""
    knobs = settings.learner.served_check
    readmitted: dict[tuple[str, int], list[str]] = {}
    for route in routes:
        for version, reasons in read_versions(client, route.alias, routed_versions(route)).items():
            fingerprint = fingerprint_of(store, route.alias, version)
            precision = fingerprint.precision if fingerprint else knobs.served_precision
            # One probe each, no waiting: the next tick asks again.
            check = ServedCheck(
                vllm_api_key(settings), knobs.timeout_s, 0.0, knobs.tolerance(precision)
            )
            served = served_name(route.alias, version, route.base_model)
            verdict = asyncio.run(check.verdict(sorted(reasons), served, fingerprint))
            back = [c.replica for c in verdict.of("match")]
            if back:
                readmit(client, route.alias, version, back)
                readmitted[route.alias, version] = back
                log.info("%s: back in %s's rotation: %s", route.alias, served, ", ".join(back))
    return readmitted
