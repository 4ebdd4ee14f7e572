"""Free ports come from outside the kernel's ephemeral range, so an outgoing connection made
between the choice and the server's bind() cannot take the port."""

from __future__ import annotations

import socket
from pathlib import Path

from kvgate.tools import readiness
from kvgate.tools.readiness import free_port, free_ports


def test_free_ports_stay_below_the_ephemeral_range_and_are_not_given_twice() -> None:
    low = readiness._ephemeral_low()
    seen: set[int] = set()
    for _ in range(50):
        base = free_ports(3)
        run = {base, base + 1, base + 2}
        assert base >= readiness._FLOOR and base + 2 < low
        assert not run & seen
        seen |= run
    assert free_port() not in seen


def test_a_port_someone_holds_is_not_given() -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:
        assert not readiness._bindable(held.getsockname()[1])
    finally:
        held.close()


def test_the_ephemeral_range_is_read_or_defaulted(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert readiness._ephemeral_low(str(f)) == 40000
    assert readiness._ephemeral_low(str(tmp_path / "missing")) == 32768
