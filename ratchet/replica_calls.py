"""What one failed call to a vLLM replica says of the replica, for the clients that pick
replicas outside the proxy (the judge's sampling, the learner's gate; ratchet.fleet.Replicas).

The proxy's rules (proxy/upstream.py), for aiohttp's errors: a call that never connected (refused,
unreachable, no connection within ``proxy.upstream_connect_timeout_s``) is safe to send to another
replica, since vLLM never saw it; one that connected and then timed out or lost its connection may
still be running on vLLM, so it is counted against the replica but never sent again. These
clients do not stream: a whole answer's first byte is its last, so their deadline for the first
byte is the call's own total timeout (``judge.sample_timeout_s``, ``learner.gate_timeout_s``).
"""

from __future__ import annotations

import aiohttp


def never_connected(error: BaseException) -> bool:
    """The call never reached vLLM: no connection was made, or none in time."""
    return isinstance(error, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def replica_fault(error: BaseException) -> bool:
    """The call failed for want of the replica: no connection, or no answer within the
    deadline. Not an answer vLLM gave (a 4xx, a reply that did not parse), nor a connection
    lost on the way (most often a pooled keep-alive the server had closed; a replica that went
    down refuses the next call, which counts)."""
    return never_connected(error) or isinstance(error, TimeoutError)


def call_timeout(total_s: float, connect_s: float | None) -> aiohttp.ClientTimeout:
    """A call's whole deadline, with its connection's own (None: within the whole)."""
    return aiohttp.ClientTimeout(total=total_s, sock_connect=connect_s)
