"""What every connection of one shaper shares: the addresses allowed, each direction's shaping,
the armed faults, the pause gate and the byte counters (:class:`Link`)."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import random
import socket
import struct
from dataclasses import dataclass, field
from typing import Literal, Protocol


class HeldStream(Protocol):
    """What a link needs of a live connection (a ShapedConn): letting go what a flip held back."""

    def release_hold(self, rule: FlipRule) -> None: ...

Direction = Literal["c2s", "s2c", "both"]
JitterDist = Literal["uniform", "normal"]

QUEUE_LIMIT = 8 << 20  # default bound of one direction's delay queue, bytes

_ALLOWED_NETS = tuple(
    ipaddress.ip_network(n)
    for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "::1/128")
)
_DIRECTIONS = {"c2s": (0,), "s2c": (1,), "both": (0, 1)}
_LINGER_RST = struct.pack("ii", 1, 0)
_BURST_S = 0.005  # token bucket depth: 5 ms of the rate ...
_MIN_BURST = 16 << 10  # ... but at least 16 KiB, so that one read is not always split up
_QUANTUM_S = 0.001  # rate-limited chunks are cut to ~1 ms of the rate ...
_QUANTUM_RANGE = (4 << 10, 64 << 10)  # ... within 4-64 KiB


def check_address(host: str, port: int, *, what: str = "address", listen: bool = False) -> tuple[str, int]:
    """``(ip, port)`` for a numeric loopback/private ``host`` (or ``localhost``); ValueError otherwise.

    Names other than ``localhost`` are refused rather than resolved: a DNS answer could point
    anywhere, and a test tool has no business waiting on DNS.
    """
    literal = "127.0.0.1" if host == "localhost" else host.strip("[]")
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        raise ValueError(f"{what} {host!r} is not a numeric IP address (or localhost)") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not any(ip in net for net in _ALLOWED_NETS):
        raise ValueError(
            f"{what} {host} is not a loopback or private address "
            "(allowed: 127/8, 10/8, 172.16/12, 192.168/16, ::1)"
        )
    lowest = 0 if listen else 1
    if not lowest <= port <= 65535:
        raise ValueError(f"{what} port {port} is out of range ({lowest}-65535)")
    return str(ip), port


def reset(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` with a real RST (SO_LINGER 0), not the FIN that abort() alone sends."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        except (OSError, ValueError):  # ValueError: uvloop, the socket is already closed
            pass
    transport.abort()


def one_direction(direction: str) -> int:
    """0 for "c2s", 1 for "s2c"; ValueError otherwise."""
    if direction not in ("c2s", "s2c"):
        raise ValueError(f"direction must be 'c2s' or 's2c', not {direction!r}")
    return _DIRECTIONS[direction][0]


def directions(direction: Direction) -> tuple[int, ...]:
    """The direction indexes "c2s", "s2c" or "both" stand for; ValueError otherwise."""
    try:
        return _DIRECTIONS[direction]
    except KeyError:
        raise ValueError(f"direction must be 'c2s', 's2c' or 'both', not {direction!r}") from None


@dataclass
class DirSettings:
    """How one direction is shaped (seconds and bytes/s)."""

    delay: float = 0.0
    jitter: float = 0.0
    dist: JitterDist = "uniform"
    rate: float | None = None
    burst: float = 0.0
    quantum: int = 0

    def shapes(self) -> bool:
        return bool(self.delay or self.jitter or self.rate)

    def extra_delay(self) -> float:
        """Delay plus one jitter sample, never negative."""
        if not self.jitter:
            return self.delay
        if self.dist == "normal":
            j = random.gauss(0.0, self.jitter)
        else:
            j = random.uniform(-self.jitter, self.jitter)
        return max(0.0, self.delay + j)

    def set_delay(self, ms: float, jitter_ms: float, dist: JitterDist) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (ms, jitter_ms)):
            raise ValueError(f"delay and jitter must be finite and >= 0 ms, not {ms} and {jitter_ms}")
        if dist not in ("uniform", "normal"):
            raise ValueError(f"jitter distribution must be 'uniform' or 'normal', not {dist!r}")
        self.delay, self.jitter, self.dist = ms / 1e3, jitter_ms / 1e3, dist

    def set_rate(self, Bps: float | None) -> None:
        if Bps is not None and not (math.isfinite(Bps) and Bps >= 0):
            raise ValueError(f"rate must be > 0 bytes/s or None, not {Bps}")
        self.rate = float(Bps) if Bps else None
        self.burst = max(self.rate * _BURST_S, _MIN_BURST) if self.rate else 0.0
        lo, hi = _QUANTUM_RANGE
        self.quantum = int(min(max(self.rate * _QUANTUM_S, lo), hi)) if self.rate else 0


@dataclass(eq=False)
class FlipRule:
    """Xor 0xFF the byte at ``offset`` of ``direction``, once, on a connection that has carried
    more than ``min_conn_bytes``."""

    offset: int
    direction: int
    min_conn_bytes: int


@dataclass(eq=False)
class CutRule:
    """Reset the next ``remaining`` connections whose ``direction`` passes ``nbytes``."""

    nbytes: int
    direction: int
    remaining: int


@dataclass(eq=False)
class Link:
    """The state one shaper's connections share; the connections read it and count into it."""

    target: tuple[str, int]
    queue_limit: int
    dirs: tuple[DirSettings, DirSettings] = field(default_factory=lambda: (DirSettings(), DirSettings()))
    paused: bool = False
    flips: list[FlipRule] = field(default_factory=list)
    cuts: list[CutRule] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=lambda: [0, 0])  # bytes, per direction
    flips_done: int = 0
    cuts_done: int = 0
    live: set[HeldStream] = field(default_factory=set)  # the connections not yet closed

    def spend_flip(self, rule: FlipRule) -> None:
        """``rule`` was applied: disarm it and let go any stream held back for it elsewhere."""
        self.flips.remove(rule)
        self.flips_done += 1
        for conn in self.live:
            conn.release_hold(rule)

    def spend_cut(self, rule: CutRule) -> None:
        """``rule`` was applied to one more connection; disarm it after its last."""
        rule.remaining -= 1
        if rule.remaining <= 0:
            self.cuts.remove(rule)
        self.cuts_done += 1
