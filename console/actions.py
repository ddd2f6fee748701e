"""The console's actions: the same Lifecycle and routing calls as the CLI's commands
(cli/lifecycle.py, cli/routing.py), with the console's admin as the actor:
``console (session <id> from <address>)`` or ``console (admin key from <address>)``.

Each returns the new route or raises ActionRefused with a sentence for the page.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kafka.errors import KafkaError

from ratchet.lifecycle import EventSink, Lifecycle, LifecycleError
from ratchet.records import DeadLetter, LifecycleEvent
from ratchet.registry import HISTORY_LIMIT, AliasRoute, RegistryWriter, set_route
from ratchet.settings import RatchetSettings
from ratchet.store import AdapterStore
from ratchet.verdict import gate_verdict

Action = Literal["promote", "rollback", "pause", "resume", "weight"]
ACTIONS: tuple[Action, ...] = ("promote", "rollback", "pause", "resume", "weight")
ACTOR = "console"  # an action whose admin is not known (not one from the web console's routes)
REASON_CHARS = 200
EVENTS_QUEUED = 1000  # events waiting for Kafka; beyond this they are dropped (and counted)
RETRY_S = 5.0

log = logging.getLogger(__name__)


class BackgroundEvents(EventSink):
    """Sends the actions' lifecycle events to ``ratchet.events`` from a thread of its own: an
    action is done once its route change is in Redis (which also keeps the event in the alias's
    history), and a Kafka outage must not hold the page for the producer's timeouts. Events wait
    and are retried while Kafka is away; past :data:`EVENTS_QUEUED` they are dropped, counted."""

    def __init__(self, settings: RatchetSettings, on_drop: Callable[[], None]) -> None:
        super().__init__(settings, timeout_s=5.0)
        self.waiting: queue.Queue[LifecycleEvent | DeadLetter] = queue.Queue(EVENTS_QUEUED)
        self.on_drop = on_drop
        threading.Thread(target=self._run, name="console-events", daemon=True).start()

    def send(self, events: Sequence[LifecycleEvent | DeadLetter]) -> None:
        for event in events:
            try:
                self.waiting.put_nowait(event)
            except queue.Full:
                self.on_drop()

    def close(self) -> None:
        pass  # the thread sends for as long as the console runs

    def _run(self) -> None:
        while True:
            event = self.waiting.get()
            while True:
                try:
                    super().send([event])
                    break
                except KafkaError as exc:
                    log.warning("lifecycle event not on Kafka yet (%s); retrying", exc)
                    time.sleep(RETRY_S)


class ActionRefused(Exception):
    pass


@dataclass(frozen=True)
class ActionRequest:
    action: Action
    alias: str
    version: int | None = None  # promote: the version (default: the running canary)
    reason: str = ""  # rollback, pause
    weight: float | None = None  # weight: the canary's new share of traffic
    actor: str = ACTOR  # who asked, as the lifecycle event names them (console/auth.py Admin)


class Actions:
    def __init__(
        self, settings: RatchetSettings, writer: RegistryWriter, events: EventSink | None = None
    ) -> None:
        assert settings.store_dir is not None
        self.settings = settings
        self.writer = writer
        self.store = AdapterStore(settings.store_dir)
        self.events = events

    def apply(self, request: ActionRequest) -> AliasRoute:
        if request.alias not in self.settings.aliases:
            raise ActionRefused(f"unknown alias {request.alias!r}")
        if request.action == "weight":
            return self._weight(request)
        lifecycle = Lifecycle(self.writer, self.store, self.events, request.actor)
        try:
            return self._lifecycle_change(lifecycle, request)
        except LifecycleError as exc:
            raise ActionRefused(str(exc)) from None

    def _lifecycle_change(self, lifecycle: Lifecycle, request: ActionRequest) -> AliasRoute:
        alias, reason = request.alias, request.reason.strip()[:REASON_CHARS] or "console"
        if request.action == "promote":
            version = request.version
            if version is None:
                version = lifecycle.route(alias).canary
                if version is None:
                    raise ActionRefused(f"{alias} has no canary; name the version to promote")
            history = self.writer.history(alias, HISTORY_LIMIT)
            verdict = gate_verdict(self.store, history, alias, version)
            if not verdict.servable:  # the console never overrides the gate: the CLI's --force does
                raise ActionRefused(
                    f"{verdict.describe()}; only `ratchet promote --force` serves it"
                )
            return lifecycle.promote(alias, version, {"via": request.actor})
        if request.action == "rollback":
            return lifecycle.rollback(alias, reason)
        if request.action == "pause":
            return lifecycle.pause(alias, reason)
        return lifecycle.resume(alias)

    def _weight(self, request: ActionRequest) -> AliasRoute:
        if request.weight is None:
            raise ActionRefused("give the canary's new weight, between 0 and 1")
        route = self.writer.read(request.alias)
        if route is None or route.canary is None:
            raise ActionRefused(f"{request.alias} has no canary to weigh")
        try:
            return set_route(self.writer, request.alias, request.actor, weight=request.weight)
        except (LookupError, ValueError) as exc:
            raise ActionRefused(str(exc)) from None
