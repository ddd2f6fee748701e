"""The server secret and what is derived from it: API-key hashes, keyed hashes, vLLM's key.

One secret keys everything a client must not be able to compute: the stored hash of its API key,
which prompts are held out for the gate, and which canary arm a caller lands on. It comes from
``secret`` (``RATCHET_SECRET``, a Kubernetes Secret in the chart); without one, the services of one
machine share a random secret created once in the state directory.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from ratchet.settings import RatchetSettings

SECRET_FILE = "secret"


def server_secret(settings: RatchetSettings) -> bytes:
    """The configured secret, else this machine's (created on first use, readable by owner only)."""
    if settings.secret is not None:
        return settings.secret.get_secret_value().encode()
    assert settings.state_dir is not None
    return _machine_secret(settings.state_dir / SECRET_FILE)


def _machine_secret(path: Path) -> bytes:
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    try:
        # O_EXCL: when two services start at once, one writes and the other reads its value.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _wait_for_contents(path)
    with os.fdopen(fd, "wb") as fh:
        fh.write(value)
        fh.flush()
        os.fsync(fh.fileno())
    return value


def _wait_for_contents(path: Path) -> bytes:
    for _ in range(1000):
        value = path.read_bytes().strip()
        if value:
            return value
    raise RuntimeError(f"{path} exists but is empty; delete it and start again")


def keyed_hash(secret: bytes, *parts: str) -> str:
    """HMAC-SHA-256 of the parts (NUL-separated), hex: stable for us, unguessable for clients."""
    return hmac.new(secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def hash_api_key(secret: bytes, key: str | None) -> str | None:
    """Keys are only ever stored as this keyed hash, so logs and Kafka never see a secret and a
    leaked hash cannot be checked against guessed keys without the server secret."""
    if not key:
        return None
    return "hmac-sha256:" + keyed_hash(secret, "api-key", key)


USER_MAX_CHARS = 256  # OpenAI's `user` is an app's id for its end user; longer is not an id


def client_source(secret: bytes, key_hash: str | None, user: str | None) -> str | None:
    """Whose evidence a request is, for the caps on one client's share of training, canary
    ratings and reward-model ratings: the key's hash, or, when ``user`` is given (only for a key
    the operator trusts to vouch for its users, ``proxy.user_vouching_keys``), a keyed hash of the
    key and that user, so that one app key serving many users counts as many clients."""
    if user is None:
        return key_hash
    return "user:" + keyed_hash(secret, "client-user", key_hash or "-", user[:USER_MAX_CHARS])


def vllm_api_key(settings: RatchetSettings) -> str:
    """The key vLLM requires: ``vllm_api_key``, else one derived from the server secret."""
    if settings.vllm_api_key is not None:
        return settings.vllm_api_key.get_secret_value()
    return keyed_hash(server_secret(settings), "vllm-api-key")
