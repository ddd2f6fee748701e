"""The lifecycle of an alias's versions: canary, promote, reject, roll back, pause, resume.

The learner and the CLI make these changes through one class, so every change is written the
same way: the route (Redis hash), the event in the alias's Redis history (same transaction), the
version's status in the adapter store, and the event on ``ratchet.events``. Redis is the source of
truth; the Kafka event is the audit trail for dashboards, sent after Redis is written.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

from ratchet.lease import Lease
from ratchet.records import DeadLetter, LifecycleEvent
from ratchet.registry import AliasRoute, InvalidRoute, RegistryWriter, RouteContended
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore

log = logging.getLogger(__name__)


class LifecycleError(Exception):
    """A change that cannot be made as asked; the message says why and what to do instead."""


class EventSink:
    """Sends LifecycleEvents to ``ratchet.events`` (and dead letters to ``ratchet.deadletter``)
    and waits for the broker's ack."""

    def __init__(self, settings: RatchetSettings, timeout_s: float = 10.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._producer: KafkaProducer | None = None

    def send(self, events: Sequence[LifecycleEvent | DeadLetter]) -> None:
        """Raise KafkaError when the broker does not take them within the timeout."""
        if not events:
            return
        if self._producer is None:
            s = self.settings
            self._producer = KafkaProducer(
                bootstrap_servers=s.kafka_bootstrap_servers,
                acks="all",
                max_block_ms=int(self.timeout_s * 1000),
                request_timeout_ms=int(self.timeout_s * 1000),
                **s.kafka.client_options(),
            )
        futures = [self._producer.send(e.TOPIC, key=e.key(), value=e.to_json()) for e in events]
        self._producer.flush(timeout=self.timeout_s)
        for future in futures:
            future.get(timeout=0)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=5)


class Lifecycle:
    def __init__(
        self,
        writer: RegistryWriter,
        store: AdapterStore,
        sink: EventSink | None,
        actor: str = "ratchet",
    ) -> None:
        self.writer = writer
        self.store = store
        self.sink = sink
        self.actor = actor
        # Events Redis has and Kafka has not taken yet, and the dead letters of records the
        # service gave up on: both must reach Kafka before the consumer's offsets move past them.
        self.unsent: list[LifecycleEvent | DeadLetter] = []
        # While set (see fenced), every change is written only if this lease is still held.
        self.fence: Lease | None = None

    @contextlib.contextmanager
    def fenced(self, lease: Lease) -> Iterator[None]:
        """Within the block, each write checks the lease in its own transaction and raises
        LeaseLost instead of writing when its holder has lost it. One Lifecycle per thread."""
        previous, self.fence = self.fence, lease
        try:
            yield
        finally:
            self.fence = previous

    # --- reading --------------------------------------------------------------------------------

    def route(self, alias: str) -> AliasRoute:
        try:
            route = self.writer.read(alias)
        except InvalidRoute as exc:
            raise LifecycleError(f"{exc}: fix or delete that hash first") from exc
        if route is None:
            raise LifecycleError(f"unknown alias {alias!r}: add it to ratchet.yaml first")
        return route

    def previous_active(self, alias: str, active: int) -> int | None:
        """The version that was live before ``active``: from the newest event that made it live,
        else its parent in the store. A rollback event is no guide: its ``previous_version`` is
        the version rolled back, which must not come back through the next rollback."""
        for event in self.writer.history(alias, limit=200):
            kind = event.get("kind")
            if kind in ("promote", "route") and event.get("version") == active:
                previous = event.get("previous_version")
                if previous is not None and previous != active:
                    return int(previous)
        if active > 0 and self.store.exists(alias, active):
            parent = self.store.meta(alias, active).get("parent_version")
            return int(parent) if parent is not None else None
        return None

    # --- changes --------------------------------------------------------------------------------

    def event(self, alias: str, kind: str, **fields: Any) -> LifecycleEvent:
        return LifecycleEvent(alias=alias, kind=kind, actor=self.actor, **fields)

    def record(self, event: LifecycleEvent, also: Callable[[Any], None] | None = None) -> None:
        """Write an event that changes no route to the alias's history, then send it to Kafka.
        (A route change goes through :meth:`change`.)"""
        try:
            self.writer.write(None, event, alias=event.alias, also=also, fence=self.fence)
        except RouteContended as exc:
            raise LifecycleError(str(exc)) from exc
        self.unsent.append(event)
        self.flush_events(raise_errors=False)

    def change(
        self,
        alias: str,
        compute: Callable[[AliasRoute], tuple[AliasRoute, LifecycleEvent]],
        also: Callable[[Any], None] | None = None,
    ) -> tuple[AliasRoute, LifecycleEvent]:
        """A route change computed from the route as it is when written (RegistryWriter.change:
        recomputed if another writer got there first), then its event sent to Kafka."""

        def known(route: AliasRoute | None) -> tuple[AliasRoute, LifecycleEvent]:
            if route is None:
                raise LifecycleError(f"unknown alias {alias!r}: add it to ratchet.yaml first")
            return compute(route)

        try:
            new, event = self.writer.change(alias, known, also, fence=self.fence)
        except InvalidRoute as exc:
            raise LifecycleError(f"{exc}: fix or delete that hash first") from exc
        except RouteContended as exc:
            raise LifecycleError(str(exc)) from exc
        self.unsent.append(event)
        self.flush_events(raise_errors=False)
        return new, event

    def flush_events(self, raise_errors: bool = True) -> bool:
        """Send the events Kafka has not taken yet; True when none are left."""
        if self.sink is None:
            self.unsent.clear()  # no sink (tests, tools without Kafka): Redis history is the record
            return True
        if not self.unsent:
            return True
        try:
            self.sink.send(self.unsent)
        except KafkaError as exc:
            log.warning("could not send %d lifecycle events to Kafka: %s", len(self.unsent), exc)
            if raise_errors:
                raise
            return False
        self.unsent.clear()
        return True

    def start_canary(
        self,
        alias: str,
        version: int,
        weight: float,
        detail: dict[str, Any],
        also: Callable[[Any], None] | None = None,
    ) -> None:

        def compute(route: AliasRoute) -> tuple[AliasRoute, LifecycleEvent]:
            self._check_servable(alias, version)
            event = self.event(
                alias,
                "canary",
                version=version,
                previous_version=route.active,
                detail={"weight": weight, **detail},
            )
            return replace(route, canary=version, canary_weight=weight), event

        self.change(alias, compute, also)

    def promote(
        self,
        alias: str,
        version: int,
        detail: dict[str, Any] | None = None,
        force: bool = False,
        also: Callable[[Any], None] | None = None,
        from_canary: bool = False,
    ) -> AliasRoute:
        """Make ``version`` the active one and end any canary. ``from_canary``: only if
        ``version`` is still the alias's canary (a decision made on a route read earlier must not
        bring back a canary that was rolled back meanwhile)."""

        def compute(route: AliasRoute) -> tuple[AliasRoute, LifecycleEvent]:
            self._check_servable(alias, version, force)
            if route.active == version and route.canary is None:
                raise LifecycleError(f"{alias} already serves v{version}")
            if from_canary and route.canary != version:
                raise LifecycleError(f"v{version} is no longer {alias}'s canary")
            event = self.event(
                alias,
                "promote",
                version=version,
                previous_version=route.active,
                detail=detail or {},
            )
            return replace(route, active=version, canary=None, canary_weight=0.0), event

        new, event = self.change(alias, compute, also)
        if version > 0:
            self.store.mark(alias, version, "promoted", {"by": self.actor, "ts": event.ts})
        return new

    def reject(
        self,
        alias: str,
        version: int,
        detail: dict[str, Any],
        also: Callable[[Any], None] | None = None,
    ) -> None:
        """Mark a candidate rejected: it stays in the store and is never served."""
        self.store.mark(alias, version, "rejected", detail)
        event = self.event(alias, "reject", version=version, detail=detail)
        self.record(event, also)

    def rollback(
        self,
        alias: str,
        reason: str,
        canary: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> AliasRoute:
        """One step back, at once: end the canary if there is one, else restore the version that
        was live before the active one. ``canary``: end that canary, and do nothing else (a second
        decision on the same canary must not roll the active version back too). ``detail``: the
        evidence, kept in the event beside the reason."""

        def compute(route: AliasRoute) -> tuple[AliasRoute, LifecycleEvent]:
            if canary is not None and route.canary != canary:
                raise LifecycleError(f"v{canary} is no longer {alias}'s canary")
            if route.canary is not None:
                bad, restored = route.canary, route.active
                new = replace(route, canary=None, canary_weight=0.0)
            else:
                previous = self.previous_active(alias, route.active)
                if previous is None:
                    raise LifecycleError(
                        f"{alias} serves v{route.active} and has no earlier version to roll back to"
                    )
                bad, restored = route.active, previous
                new = replace(route, active=previous)
            event = self.event(
                alias,
                "rollback",
                version=restored,
                previous_version=bad,
                detail={**(detail or {}), "reason": reason},
            )
            return new, event

        new, event = self.change(alias, compute)
        bad = event.previous_version
        if bad:
            self.store.mark(alias, bad, "rolled_back", {"reason": reason, "ts": event.ts})
        return new

    def pause(self, alias: str, reason: str, detail: dict[str, Any] | None = None) -> AliasRoute:
        event = self.event(alias, "pause", detail={"reason": reason, **(detail or {})})
        new, _ = self.change(alias, lambda route: (replace(route, paused=True), event))
        return new

    def resume(self, alias: str) -> AliasRoute:

        def compute(route: AliasRoute) -> tuple[AliasRoute, LifecycleEvent]:
            if not route.paused:
                raise LifecycleError(f"learning for {alias} is not paused")
            return replace(route, paused=False), self.event(alias, "resume")

        new, _ = self.change(alias, compute)
        return new

    def _check_servable(self, alias: str, version: int, force: bool = False) -> None:
        if version == 0:
            return
        if not self.store.exists(alias, version):
            raise LifecycleError(f"{alias}@v{version} is not in the adapter store")
        if self.store.is_rejected(alias, version) and not force:
            raise LifecycleError(
                f"{alias}@v{version} was rejected by the gate; pass --force to serve it anyway"
            )
