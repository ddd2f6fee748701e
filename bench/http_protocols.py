"""What uvicorn's HTTP protocol costs a request: h11, httptools, and the proxy's and the
console's subclasses of them (proxy/connection.py, console/guard.py), which add the deadlines
and limits no public uvicorn option offers.

Run it from the repository root (about a minute)::

    .venv/bin/python bench/http_protocols.py [--requests 3000]

Method: for each protocol, uvicorn (uvloop, as the proxy runs) serves a bare ASGI app that
answers every request with the same 300-byte JSON body, in its own process. One client sends
``--requests`` GETs, one after the other, over one keep-alive connection (a raw socket: no client
library in the figure) after 200 unmeasured ones. Reported: the round trip's p50 and p99 in ms.
The app does nothing, so the difference between rows is the protocol's own cost per request.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedded.processes import free_port, port_open, wait_until

BODY = b'{"object": "bench", "text": "' + b"x" * 260 + b'"}'
WARMUP = 200


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def serve(protocol: str, port: int) -> None:
    import uvicorn

    from ratchet.settings import ProxySettings

    http: Any = protocol
    if protocol == "proxy (httptools subclass)":
        from proxy.connection import guarded_protocol

        http = guarded_protocol(ProxySettings())
    elif protocol == "console (h11 subclass)":
        from console.guard import ConsoleProtocol

        http = ConsoleProtocol
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http=http, log_level="error")


def round_trips(port: int, requests: int) -> list[float]:
    """Seconds per request, one keep-alive connection, each answer read whole first."""
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(WARMUP + requests):
            began = time.perf_counter()
            conn.sendall(request)
            answer = b""
            while not answer.endswith(BODY):
                chunk = conn.recv(65536)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                answer += chunk
            if i >= WARMUP:
                times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    protocols = ["h11", "console (h11 subclass)", "httptools", "proxy (httptools subclass)"]
    print(f"{'protocol':30} {'p50 ms':>8} {'p99 ms':>8}")
    for protocol in protocols:
        port = free_port()
        server = multiprocessing.Process(target=serve, args=(protocol, port), daemon=True)
        server.start()
        try:
            wait_until(lambda p=port: port_open("127.0.0.1", p), 30, f"uvicorn with {protocol}")
            times = sorted(round_trips(port, args.requests))
        finally:
            server.terminate()
            server.join(10)
        p50 = statistics.median(times) * 1e3
        p99 = times[int(0.99 * (len(times) - 1))] * 1e3
        print(f"{protocol:30} {p50:8.3f} {p99:8.3f}")


if __name__ == "__main__":
    main()
