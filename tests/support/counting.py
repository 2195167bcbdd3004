"""A transport passed through with its write calls counted (tests of how connections write)."""

from __future__ import annotations


class Counting:
    """The transport, passed through, with its write calls counted."""

    def __init__(self, transport) -> None:
        self._t = transport
        self.writes = 0

    def write(self, data) -> None:
        self.writes += 1
        self._t.write(data)

    def writelines(self, data) -> None:
        self.writes += 1
        self._t.writelines(data)

    def __getattr__(self, name):
        return getattr(self._t, name)
