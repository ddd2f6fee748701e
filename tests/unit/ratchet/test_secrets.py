"""The machine secret file (ratchet/secrets.py): made whole or not at all, shared by services that
start at once, and refused when it is empty, short, or readable by others; and the Redis URL with
its password, which every Redis client connects with."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from pydantic import SecretStr

from ratchet.secrets import MIN_SECRET_CHARS, SECRET_FILE, redis_connection_url, server_secret
from ratchet.settings import RatchetSettings


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RatchetSettings:
    for name in list(os.environ):
        if name.upper().startswith("RATCHET_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no ./ratchet.yaml
    return RatchetSettings(home=tmp_path / "home")


def secret_file(settings: RatchetSettings) -> Path:
    assert settings.state_dir is not None
    return settings.state_dir / SECRET_FILE


def test_created_once_owner_only_and_nothing_left_beside_it(settings: RatchetSettings) -> None:
    first = server_secret(settings)
    path = secret_file(settings)
    assert len(first) == 64 and path.read_bytes() == first
    assert path.stat().st_mode & 0o777 == 0o600
    assert server_secret(settings) == first
    assert [p.name for p in path.parent.iterdir()] == [SECRET_FILE]  # no temporary file left


def test_services_starting_at_once_agree_on_one_secret(settings: RatchetSettings) -> None:
    got: list[bytes] = []
    start = threading.Barrier(8)

    def one() -> None:
        start.wait()
        got.append(server_secret(settings))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert secret_file(settings).read_bytes() == got[0]


@pytest.mark.parametrize(
    "content", [b"", b"\n", b"   \n", b"abc", b"x" * (MIN_SECRET_CHARS - 1)], ids=repr
)
def test_an_empty_or_short_secret_file_is_refused(
    settings: RatchetSettings, content: bytes
) -> None:
    """What a crash or a full disk mid-write used to leave, and every service then used as the
    secret: key hashes and vLLM's key anyone could compute."""
    path = secret_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(RuntimeError) as refused:
        server_secret(settings)
    message = str(refused.value)
    assert str(path) in message and "Delete it" in message and "RATCHET_SECRET" in message


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o666])
def test_a_secret_file_others_can_read_is_refused(settings: RatchetSettings, mode: int) -> None:
    value = server_secret(settings)
    path = secret_file(settings)
    path.chmod(mode)
    with pytest.raises(RuntimeError) as refused:
        server_secret(settings)
    assert "chmod 600" in str(refused.value)
    path.chmod(0o600)
    assert server_secret(settings) == value


def test_a_secret_file_that_is_a_symlink_is_refused(settings: RatchetSettings) -> None:
    path = secret_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = path.parent / "elsewhere"
    elsewhere.write_bytes(b"a" * 64)
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)
    with pytest.raises(OSError):
        server_secret(settings)


def test_a_configured_secret_needs_no_file(settings: RatchetSettings) -> None:
    configured = settings.model_copy(update={"secret": SecretStr("s" * 40)})
    assert server_secret(configured) == b"s" * 40
    assert not secret_file(settings).exists()


def test_the_embedded_redis_gets_a_password_derived_from_the_secret(
    settings: RatchetSettings,
) -> None:
    """The default redis_url names the Redis `ratchet up` starts: every process of the stack
    derives the same password from the secret, and another secret gives another password."""
    url = redis_connection_url(settings)
    password = redis.connection.parse_url(url)["password"]
    assert len(password) == 64 and password in url
    assert url == redis_connection_url(RatchetSettings(home=settings.home))  # another process
    other = RatchetSettings(home=settings.home, secret=SecretStr("o" * 64))
    assert redis.connection.parse_url(redis_connection_url(other))["password"] != password


def test_a_redis_url_that_is_set_is_used_as_given(settings: RatchetSettings) -> None:
    # Someone's own Redis, password-less on loopback or with the password in the URL.
    for url in ("redis://127.0.0.1:6399/0", "redis://10.0.0.5:6379/2", "rediss://:pw@r:6380/0"):
        assert redis_connection_url(RatchetSettings(home=settings.home, redis_url=url)) == url


def test_redis_password_replaces_the_urls_and_keeps_its_user(settings: RatchetSettings) -> None:
    password = 'p@ss:w/rd "%'
    for url, user in (
        ("redis://ops:old@10.0.0.5:6379/2", "ops"),
        ("rediss://ratchet@r.example:6380/0?ssl_ca_certs=/ca.pem", "ratchet"),
        ("redis://127.0.0.1:6399/0", None),
    ):
        s = RatchetSettings(home=settings.home, redis_url=url, redis_password=SecretStr(password))
        parsed = redis.connection.parse_url(redis_connection_url(s))
        assert parsed["password"] == password
        assert parsed.get("username") == user
        assert parsed["host"] == urlsplit(url).hostname and parsed["port"] == urlsplit(url).port
    s = RatchetSettings(home=settings.home, redis_password=SecretStr(password))
    assert redis.connection.parse_url(redis_connection_url(s))["password"] == password
