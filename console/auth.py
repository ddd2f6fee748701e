"""Who may read the console and who may act on it.

Reading: anyone when the console is bound to loopback (as the proxy serves without keys there);
otherwise only with the admin key. Acting (promote, rollback, pause, resume, canary weight):
always only with the admin key, ``proxy.admin_key``, sent as ``Authorization: Bearer <key>`` or
set once through the login form, which stores a session token in an HTTP-only, SameSite=Strict
cookie. The token is a keyed hash of the admin key under the server secret: the key itself never
leaves the login request, and changing either invalidates every session.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from ratchet.secrets import keyed_hash, server_secret
from ratchet.settings import RatchetSettings

COOKIE = "ratchet_console"


class ConsoleAuth:
    def __init__(self, settings: RatchetSettings) -> None:
        key = settings.proxy.admin_key
        self.admin_key = key.get_secret_value() if key is not None else None
        self.session_token = (
            keyed_hash(server_secret(settings), "console-session", self.admin_key)
            if self.admin_key is not None
            else None
        )
        self.login_required = settings.console_needs_login

    @property
    def actions_enabled(self) -> bool:
        return self.admin_key is not None

    def key_matches(self, key: str) -> bool:
        return self.admin_key is not None and hmac.compare_digest(
            key.encode(), self.admin_key.encode()
        )

    def is_admin(self, request: Request) -> bool:
        """The request carries the admin key, or a session made with it."""
        if self.admin_key is None or self.session_token is None:
            return False
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and self.key_matches(header[7:].strip()):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self.session_token.encode())

    def may_read(self, request: Request) -> bool:
        return not self.login_required or self.is_admin(request)
