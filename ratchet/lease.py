"""Leases in Redis: at most one holder of a name at a time, for as long as it keeps renewing.

A lease is one string key set with ``SET key token NX PX ttl``: the token names the holder (its
host and process, plus a random part, so two holders in one process differ). Renewing and
releasing compare the token first, in one Lua script, so a holder whose lease expired (it
stalled, or Redis lost the key) can never extend or delete the lease another holder took since.
A holder that dies simply stops renewing: the lease is free again after ``ttl``.

:class:`LeaseKeeper` renews held leases from a thread every third of their TTL and reports one
it could not renew as lost; a writer that must act only while it holds a lease also fences its
write with it (``RegistryWriter.change(..., fence=lease)`` watches the key and checks the token
inside the same transaction), so even a holder that stalled past its TTL between checking and
writing cannot write.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

# KEYS[1]: the lease; ARGV[1]: the holder's token; ARGV[2]: the TTL in ms. 1 if still ours.
RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1]: the lease; ARGV[1]: the holder's token. 1 if it was ours and is now free.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseLost(RuntimeError):
    """A lease its holder no longer holds: whatever it guarded must not be done."""


def holder_name() -> str:
    """Who holds a lease, for people reading Redis: the host (the pod's name) and the pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _text(value: bytes | str | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class Lease:
    """One named lease, as one would-be holder sees it (each Lease object is its own holder)."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a lease's TTL must be positive, not {ttl_s}")
        self.client = client
        self.key = key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.token = f"{holder_name()}:{uuid.uuid4().hex[:12]}"

    @property
    def ttl_s(self) -> float:
        return self.ttl_ms / 1000

    def acquire(self) -> bool:
        """Take the lease if it is free (or renew it if it is already ours); True if held now."""
        if self.client.set(self.key, self.token, nx=True, px=self.ttl_ms):
            return True
        return self.renew()

    def renew(self) -> bool:
        """Extend the lease by its TTL if it is still ours; False if it expired or was taken."""
        return bool(self.client.eval(RENEW_SCRIPT, 1, self.key, self.token, self.ttl_ms))

    def release(self) -> bool:
        """Free the lease at once if it is ours (never someone else's); True if it was ours."""
        return bool(self.client.eval(RELEASE_SCRIPT, 1, self.key, self.token))

    def held(self) -> bool:
        return _text(self.client.get(self.key)) == self.token

    def holder(self) -> str | None:
        """The token of whoever holds it now (None: free)."""
        return _text(self.client.get(self.key))

    def check(self, value: bytes | str | None) -> None:
        """Raise LeaseLost unless ``value`` (the key's value, read inside a transaction) is
        this holder's token."""
        if _text(value) != self.token:
            raise LeaseLost(f"{self.key} is no longer held by {self.token} (now: {_text(value)})")


class LeaseKeeper:
    """Renews the leases it is given, from one daemon thread, until they are dropped.

    ``on_lost(lease)`` is called (from the thread) for a lease that could not be renewed because
    someone else holds it or it expired; the keeper stops renewing it. A Redis error is retried
    at the next tick: the lease stays ours until its TTL runs out, and the fenced write finds out.
    """

    def __init__(self, on_lost: Callable[[Lease], None] | None = None) -> None:
        self.on_lost = on_lost
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def keep(self, lease: Lease) -> None:
        with self._lock:
            self._leases[id(lease)] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="leases", daemon=True)
                self._thread.start()
        self._wake.set()  # a shorter TTL than the others: recompute the tick

    def drop(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _tick_s(self) -> float:
        with self._lock:
            ttls = [lease.ttl_s for lease in self._leases.values()]
        # A third of the shortest TTL: two renewals can fail (a Redis blip) before it expires.
        return min(ttls) / 3 if ttls else 1.0

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._tick_s())
            self._wake.clear()
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                try:
                    self._renew(lease)
                except Exception:  # the thread must outlive any one lease's failure
                    log.exception("renewing %s failed; retrying", lease.key)

    def _renew(self, lease: Lease) -> None:
        try:
            renewed = lease.renew()
        except (redis.RedisError, OSError) as exc:
            log.warning("could not renew %s (%s); retrying", lease.key, exc)
            return
        with self._lock:
            if renewed or id(lease) not in self._leases:
                return  # renewed, or released (and dropped) while we asked: nothing was lost
            self._leases.pop(id(lease), None)
        log.warning("lease %s lost: it expired or another holder took it", lease.key)
        if self.on_lost is not None:
            self.on_lost(lease)
