"""Console logins: random server-side sessions in Redis, and a throttle on wrong admin keys.

A login gets a random token (the cookie); Redis keeps only its SHA-256, under
``ratchet:console:session:<hash>`` with a TTL of ``console.session_ttl_s``, so whoever reads Redis
cannot act as a logged-in admin. Logout deletes it, so a copied cookie dies with the session. The
session also records a keyed hash of the admin key it was made with: changing the key ends every
session.

Wrong admin keys (at the login form or in an ``Authorization`` header) are counted per source
address and for the whole console over :data:`FAILURE_WINDOW_S`, and each wrong answer is held
back by :func:`wrong_key_delay`, or its turn in the console's one bucket of wrong keys if later
(console/wrong_keys.py: many guessers in parallel as slow as one; console/guard.py holds the
answer). The key is always checked first: the
right key gets in at once whatever the counts, so no outsider can lock the admins out (security
audit N-9: a refusal before the check let about 7 wrong logins a minute refuse the right key).
What slows a guesser, and why the key's length is what really stops one: docs/security.md,
"The console". Without Redis nobody logs in (the ``Authorization`` header still works).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass

import redis

from ratchet.secrets import keyed_hash, redis_connection_url, server_secret
from ratchet.settings import RatchetSettings

SESSION_KEY = "ratchet:console:session:"  # + the token's SHA-256
FAILURES_KEY = "ratchet:console:login_failures:"  # + the source address, or ALL
ALL = "all"
FAILURE_WINDOW_S = 15 * 60
FREE_FAILURES_PER_SOURCE = 5  # wrong keys from one address answered at once (typos)
BACKOFF_START_S = 0.5  # the next wrong answer's delay; it doubles with each one after
BACKOFF_MAX_S = 8.0  # below Guard's deadlines: a held answer costs no more than a slow client
FAILURES_IN_ALL = 100  # wrong keys from everywhere per window; past it each waits the most
TOKEN_BYTES = 32


@dataclass(frozen=True)
class Session:
    token: str  # the cookie's value
    id: str  # a short hash of the token: names the session in logs and lifecycle events


def session_id(token: str) -> str:
    return _digest(token)[:12]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Sessions:
    def __init__(self, settings: RatchetSettings, admin_key: str) -> None:
        self.redis = redis.Redis.from_url(
            redis_connection_url(settings), socket_timeout=2, socket_connect_timeout=2
        )
        self.ttl_s = settings.console.session_ttl_s
        self.key_mark = keyed_hash(server_secret(settings), "console-admin-key", admin_key)

    def start(self, source: str) -> Session:
        """A new session (RedisError: none was stored)."""
        token = secrets.token_urlsafe(TOKEN_BYTES)
        value = json.dumps({"key": self.key_mark, "source": source, "since": int(time.time())})
        self.redis.set(SESSION_KEY + _digest(token), value, ex=self.ttl_s)
        return Session(token, session_id(token))

    def valid(self, token: str) -> bool:
        """The token is a live session made with today's admin key (False without Redis)."""
        if not token or len(token) > 2 * TOKEN_BYTES:
            return False
        try:
            raw = self.redis.get(SESSION_KEY + _digest(token))
        except (redis.RedisError, OSError):
            return False
        if raw is None:
            return False
        try:
            mark = json.loads(raw).get("key")
        except (ValueError, AttributeError):
            return False
        return isinstance(mark, str) and secrets.compare_digest(mark, self.key_mark)

    def end(self, token: str) -> None:
        """Revoke it (RedisError: it may still be live until its TTL)."""
        self.redis.delete(SESSION_KEY + _digest(token))

    def failed(self, source: str) -> float:
        """Count a wrong key (the window starts at the first one); how long to hold its answer
        (RedisError: not counted)."""
        with self.redis.pipeline(transaction=True) as pipe:
            for key in (FAILURES_KEY + source, FAILURES_KEY + ALL):
                pipe.incr(key)
                pipe.expire(key, FAILURE_WINDOW_S, nx=True)
            mine, _, everyone, _ = pipe.execute()
        return wrong_key_delay(int(mine), int(everyone))


def wrong_key_delay(mine: int, everyone: int) -> float:
    """Seconds to hold the answer to a wrong key, the ``mine``-th from its address and the
    ``everyone``-th overall in the window: none for the first few from an address, then
    doubling per address, and the most for all while wrong keys come faster than
    FAILURES_IN_ALL a window from everywhere."""
    if everyone > FAILURES_IN_ALL:
        return BACKOFF_MAX_S
    past = mine - FREE_FAILURES_PER_SOURCE
    if past <= 0:
        return 0.0
    return float(min(BACKOFF_START_S * 2 ** min(past - 1, 32), BACKOFF_MAX_S))
