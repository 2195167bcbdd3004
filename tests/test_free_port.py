"""The test and benchmark harness's port picker (pdd_tools.harness.free_port): ports a server
started later can still bind, out of the kernel's ephemeral range where outgoing connections and
``bind(0)`` calls would take them."""

import socket

from pdd_tools import harness


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    lo, _ = harness._ephemeral_range()
    ports = [harness.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if lo - 20000 >= 2048:  # the range leaves room below it (Linux's default 32768-60999 does)
        assert all(20000 <= p < lo for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: a server given this port can bind it


def test_a_port_in_use_is_skipped(monkeypatch):
    spare = harness.free_port()  # free when checked, not bound here
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(harness, "_ephemeral_range", lambda: (40000, 60999))

        class Rng:  # the picker's first try is the taken port, then the spare one
            tries = iter([taken, spare])

            def randrange(self, a, b):
                return next(self.tries)

        monkeypatch.setattr(harness.random, "Random", Rng)
        monkeypatch.setattr(harness, "_HANDED_OUT", set())
        assert harness.free_port() == spare


def test_a_narrow_range_falls_back_to_the_kernels_pick(monkeypatch):
    """Under 2048 ports below the range: the picker does not search them, the kernel picks
    (from its real range, which the patched one only pretends to move), and the port is free."""
    real_lo, real_hi = harness._ephemeral_range()
    monkeypatch.setattr(harness, "_ephemeral_range", lambda: (21000, 60999))
    p = harness.free_port()
    assert real_lo <= p <= real_hi, p
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
