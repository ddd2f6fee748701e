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
from urllib.parse import quote, urlsplit, urlunsplit

from ratchet.settings import RatchetSettings

SECRET_FILE = "secret"


def server_secret(settings: RatchetSettings) -> bytes:
    """The configured secret, else this machine's (created on first use, readable by owner only)."""
    if settings.secret is not None:
        return settings.secret.get_secret_value().encode()
    assert settings.state_dir is not None
    return _machine_secret(settings.state_dir / SECRET_FILE)


# The machine secret is 64 hex characters; a file holding fewer than this is not one we wrote
# whole (a crash or a full disk mid-write, or someone's edit) and is refused, never used.
MIN_SECRET_CHARS = 32


def _machine_secret(path: Path) -> bytes:
    """This machine's secret at ``path``: read if it exists, else created.

    Created whole or not at all: written to a temporary file in the same folder, synced, then
    linked to its name, which fails if another service linked its own first (their value is
    then read). So no reader ever sees an empty or partial secret, and two services starting at
    once agree on one.
    """
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(value)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # a rename that never replaces: the first writer's value wins
        except FileExistsError:
            return _read_secret(path)
        _sync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return value


def _read_secret(path: Path) -> bytes:
    """The secret in ``path``, refused (RuntimeError naming the file and the fix) unless it is
    the current user's, readable by nobody else, and long enough to be one."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise RuntimeError(
                f"{path} holds the server secret but is owned by uid {info.st_uid} with mode "
                f"{info.st_mode & 0o777:o}; it must be this user's (uid {os.getuid()}) and mode "
                f"600: run 'chmod 600 {path}' (and chown it), or set RATCHET_SECRET"
            )
        value = fh.read(4096).strip()
    if len(value) < MIN_SECRET_CHARS:
        raise RuntimeError(
            f"{path} holds {len(value)} characters, not a server secret (at least "
            f"{MIN_SECRET_CHARS}): it was cut short or edited. Delete it to have a new one made "
            "(API-key hashes and held-out prompts made with the old one then change), or set "
            "RATCHET_SECRET"
        )
    return value


def _sync_folder(folder: Path) -> None:
    """Make the new name durable: after a crash, the secret is there or not, never empty."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def redis_connection_url(settings: RatchetSettings) -> str:
    """The URL every client of Redis connects with, password included.

    ``redis_password`` replaces any password in ``redis_url``. Without either, the default URL
    (the embedded stack's Redis, which `ratchet up` starts requiring this password) gets one
    derived from the server secret, so every process of this machine's stack agrees on it
    without it being written anywhere; any other URL is used as given.
    """
    if settings.redis_password is not None:
        password = settings.redis_password.get_secret_value()
    elif "redis_url" not in settings.model_fields_set:  # left at DEFAULT_REDIS_URL
        password = keyed_hash(server_secret(settings), "redis-password")
    else:
        return settings.redis_url
    return with_password(settings.redis_url, password)


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` (percent-encoded) in place of any it had; a username is kept."""
    parts = urlsplit(url)
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]  # as written: already percent-encoded
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))
