"""free_port chooses below the OS's ephemeral range, where no port-0 socket of another process
(vLLM's workers open many as a stack starts) can take the port before its service binds it."""

from __future__ import annotations

import socket

import pytest

from embedded import processes
from embedded.processes import CHOSEN_PORTS_FROM, ephemeral_ports, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(50)}
    assert all(CHOSEN_PORTS_FROM <= port < low for port in ports), ports
    assert len(ports) > 40  # at random: two stacks started at once do not pick alike
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_a_port_in_use_is_never_given() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        assert port not in {free_port() for _ in range(200)}


def test_without_room_below_the_range_the_os_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    low, high = ephemeral_ports()
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: (CHOSEN_PORTS_FROM + 10, high))
    port = free_port()
    assert low <= port <= high  # the OS's pick
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
