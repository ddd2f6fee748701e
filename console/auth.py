"""Who may read the console and who may act on it.

Reading: anyone when the console is bound to loopback (as the proxy serves without keys there);
otherwise only an admin. Acting (promote, rollback, pause, resume, canary weight): only an admin.
An admin is a request with the admin key, ``proxy.admin_key``, as ``Authorization: Bearer <key>``,
or with the cookie of a session made by logging in with it (console/sessions.py: random,
server-side, expiring, revoked at logout; the key itself never leaves the login request).

The key is checked before anything else, so the right one always gets in. A wrong one, wherever it
is sent, is counted per source address and overall, and its answer is held back
(console/sessions.py says how long, console/wrong_keys.py paces all wrong keys together,
console/guard.py holds it): the delay is left on the request's state as ``wrong_key_delay``,
only on a wrong key's request, so the right key's answer is never held.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Literal

import redis
from fastapi import Request

from console.guard import WRONG_KEY_DELAY
from console.sessions import BACKOFF_START_S, Session, Sessions, session_id
from ratchet.settings import RatchetSettings

COOKIE = "ratchet_console"
Refusal = Literal["wrong", "unavailable"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admin:
    """Who acts: how they proved it and from where, for lifecycle events and the log."""

    via: str  # "session <id>" or "admin key"
    source: str

    @property
    def actor(self) -> str:
        return f"console ({self.via} from {self.source})"


def source_of(request: Request) -> str:
    """The peer's address (forwarding headers are not trusted: any client can send them)."""
    return request.client.host if request.client else "unknown"


class ConsoleAuth:
    def __init__(self, settings: RatchetSettings) -> None:
        key = settings.proxy.admin_key
        self.admin_key = key.get_secret_value() if key is not None else None
        self.sessions = Sessions(settings, self.admin_key) if self.admin_key else None
        self.login_required = settings.console_needs_login

    @property
    def actions_enabled(self) -> bool:
        return self.admin_key is not None

    def key_matches(self, key: str) -> bool:
        return self.admin_key is not None and hmac.compare_digest(
            key.encode(), self.admin_key.encode()
        )

    def admin(self, request: Request) -> Admin | None:
        """The request's admin, if it has one (worked out once per request: it asks Redis)."""
        if not hasattr(request.state, "admin"):
            request.state.admin = self._admin(request)
        found: Admin | None = request.state.admin
        return found

    def is_admin(self, request: Request) -> bool:
        return self.admin(request) is not None

    def may_read(self, request: Request) -> bool:
        return not self.login_required or self.is_admin(request)

    def login(self, request: Request, key: str) -> Session | Refusal:
        """A new session for the admin key, or why not (a wrong key's delay on the request)."""
        source = source_of(request)
        if self.sessions is None:
            return "wrong"
        if not self.key_matches(key):
            setattr(request.state, WRONG_KEY_DELAY, self._count_failure(source, "login"))
            return "wrong"
        try:
            session = self.sessions.start(source)
        except (redis.RedisError, OSError) as exc:
            log.warning("console login from %s refused: no Redis for sessions (%s)", source, exc)
            return "unavailable"
        log.info("console login from %s: session %s", source, session.id)
        return session

    def logout(self, request: Request) -> None:
        token = request.cookies.get(COOKIE, "")
        if self.sessions is None or not token:
            return
        try:
            self.sessions.end(token)
        except (redis.RedisError, OSError) as exc:
            log.warning("console logout could not revoke session %s: %s", session_id(token), exc)
            return
        log.info("console logout from %s: session %s", source_of(request), session_id(token))

    def _admin(self, request: Request) -> Admin | None:
        if self.sessions is None:
            return None
        source = source_of(request)
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            if self.key_matches(header[7:].strip()):
                return Admin("admin key", source)
            delay = self._count_failure(source, "Authorization header")
            setattr(request.state, WRONG_KEY_DELAY, delay)
            return None
        token = request.cookies.get(COOKIE, "")
        if token and self.sessions.valid(token):
            return Admin(f"session {session_id(token)}", source)
        return None

    def _count_failure(self, source: str, where: str) -> float:
        """Count it; how long to hold its answer (without Redis: the first step of the
        backoff, as nothing says how many came before)."""
        log.warning("console: wrong admin key from %s (%s)", source, where)
        assert self.sessions is not None
        try:
            return self.sessions.failed(source)
        except (redis.RedisError, OSError) as exc:
            log.warning("console: wrong key from %s not counted: %s", source, exc)
            return BACKOFF_START_S
