"""A TCP forwarder that can take its upstream away the way a dead server does.

``close()`` closes the listening socket and every connection through it, so a new connect is
refused (ECONNREFUSED, what a stopped vLLM gives) and a kept-alive one ends; ``open()`` listens
on the same port again. The test_faults proxy reaches vLLM only through one, so vLLM itself
keeps running and is never cold-started by a test.
"""

from __future__ import annotations

import selectors
import socket
import threading


class Forwarder:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0  # chosen by the first open(), kept by every later one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def open_now(self) -> bool:
        return self._thread is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        assert self._thread is None, "already open"
        # SO_REUSEADDR (create_server's default): the port is free again at once although the
        # connections closed before hold it in TIME_WAIT.
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._serve, args=(listener,), name="forwarder", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Returns once the port refuses connections and every forwarded one is closed."""
        assert self._thread is not None, "not open"
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the forwarder did not stop"
        self._thread = None

    def _serve(self, listener: socket.socket) -> None:
        # One thread for the listener and every connection: the traffic is a few test requests.
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        peers: dict[socket.socket, socket.socket] = {}
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is listener:
                        self._accept(listener, selector, peers)
                    else:
                        self._relay(sock, selector, peers)
        finally:
            for sock in [listener, *peers]:
                selector.unregister(sock)
                sock.close()
            selector.close()

    def _accept(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        peers: dict[socket.socket, socket.socket],
    ) -> None:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()  # upstream gone: the client sees its connection end
            return
        for sock in (client, upstream):
            # Blocking sends with a deadline: both ends read promptly (the proxy and vLLM).
            sock.settimeout(30)
            selector.register(sock, selectors.EVENT_READ, None)
        peers[client], peers[upstream] = upstream, client

    def _relay(
        self,
        sock: socket.socket,
        selector: selectors.BaseSelector,
        peers: dict[socket.socket, socket.socket],
    ) -> None:
        other = peers[sock]
        try:
            data = sock.recv(65536)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        # One side ended (or failed): end both, as a proxy in between would.
        for end in (sock, other):
            selector.unregister(end)
            end.close()
            del peers[end]
