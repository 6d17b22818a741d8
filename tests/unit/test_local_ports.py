"""`rlfabric.local.ports.free_port`: below the kernel's ephemeral range, never the same port twice."""

from __future__ import annotations

import socket

import pytest

from rlfabric.local import ports


def test_ports_lie_below_the_ephemeral_range_and_differ() -> None:
    top = ports.ephemeral_start()
    chosen = [ports.free_port() for _ in range(50)]
    assert len(set(chosen)) == 50
    assert all(ports.FLOOR <= p < top for p in chosen), (top, chosen)
    for port in chosen[:5]:  # each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bind_to_port_zero_never_takes_a_chosen_port() -> None:
    """What the range buys: the kernel's own choices (port 0, outgoing connections) come from above."""
    chosen = {ports.free_port() for _ in range(20)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] not in chosen
        assert s.getsockname()[1] >= ports.ephemeral_start()


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        draws = iter([port, port, port])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws, ports.FLOOR + 7))
        monkeypatch.setattr(ports, "ephemeral_start", lambda: port + 1000)
        monkeypatch.setattr(ports, "FLOOR", port - 10)
        assert ports.free_port() != port
    finally:
        taken.close()


def test_without_a_range_below_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.FLOOR + 10)
    port = ports.free_port()
    assert port >= 1024
