"""Running the proxy under uvicorn (``ratchet proxy``).

The server's own limits: the connection protocol of proxy/connection.py (header and body
deadlines, header size, parser errors and overload answered with the envelope), keep-alive
timeout and concurrency limit from the settings, no WebSocket upgrades, no ``server`` header. The
rule "no keys only on loopback" is checked on the sockets uvicorn actually bound: a host name
that resolves to a public address is refused even though its name looked harmless.
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import socket
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI

from proxy.app import create_app
from proxy.connection import guarded_protocol
from ratchet.settings import ConfigError, RatchetSettings

log = logging.getLogger(__name__)
STARTUP_FAILURE = 3  # uvicorn's exit status when it cannot start


def server_config(app: FastAPI, settings: RatchetSettings) -> uvicorn.Config:
    proxy = settings.proxy
    return uvicorn.Config(
        app,
        host=proxy.host,
        port=proxy.port,
        # uvloop + httptools: the fastest event loop and HTTP parser uvicorn offers.
        loop="uvloop",
        http=guarded_protocol(proxy),
        ws="none",
        access_log=False,
        log_level="info",
        server_header=False,
        timeout_keep_alive=proxy.keepalive_timeout_s,  # type: ignore[arg-type]  # a float works
        limit_concurrency=proxy.max_concurrency,
        # Long enough for in-flight streams to finish and the log queue to drain.
        timeout_graceful_shutdown=30,
    )


def exposure_refusal(settings: RatchetSettings, addresses: list[Any]) -> str | None:
    """Why the proxy must not serve on these bound addresses (``getsockname()`` values), if it
    must not: without keys, every one of them has to be a loopback address."""
    if settings.auth_enabled:
        return None
    exposed = [_show(address) for address in addresses if not _is_loopback(address)]
    if not exposed:
        return None
    return (
        f"proxy.api_keys is empty but the proxy is listening on {', '.join(exposed)} "
        f"(proxy.host is {settings.proxy.host!r}), which is not a loopback address: running "
        "without auth is only allowed on loopback. Set RATCHET_PROXY__API_KEYS (a JSON list) or "
        "proxy.api_keys in ratchet.yaml, or set proxy.host to 127.0.0.1"
    )


def _is_loopback(address: Any) -> bool:
    if isinstance(address, str):  # a Unix socket path: reachable only on this machine
        return True
    try:
        ip = ipaddress.ip_address(address[0].split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _show(address: Any) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProxyServer(uvicorn.Server):
    """uvicorn's server, which refuses to serve when the sockets it bound break the loopback
    rule: checked right after binding, before the event loop accepts a single connection."""

    def __init__(self, config: uvicorn.Config, settings: RatchetSettings) -> None:
        super().__init__(config)
        self.settings = settings
        self.refusal: str | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        bound = [s.getsockname() for server in self.servers for s in server.sockets]
        self.refusal = exposure_refusal(self.settings, bound)
        if self.refusal is not None:
            for server in self.servers:
                server.close()
            log.error("refusing to serve: %s", self.refusal)
            self.should_exit = True


def serve(settings: RatchetSettings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = create_app(settings)
    # Everything imported and built so far lives as long as the process: out of the collector's
    # sight, a full collection no longer walks it, which is a pause in the middle of requests.
    gc.freeze()
    server = ProxyServer(server_config(app, settings), settings)
    # uvicorn re-raises the signal it stopped on; Ctrl-C after a clean stop is no error.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if server.refusal is not None:
        raise ConfigError(f"invalid Ratchet settings:\n  {server.refusal}")
    if not server.started:
        sys.exit(STARTUP_FAILURE)
