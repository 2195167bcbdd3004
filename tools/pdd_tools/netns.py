"""Two emulated sites on one machine: two network namespaces joined by a veth pair, the "WAN".

Why: the demo and the fault-injection suite want site A's and site B's processes to talk over
a link that can be rate-limited and cut, without a second machine.  :class:`TwoSites` makes

* namespaces ``<prefix>-a`` and ``<prefix>-b`` (prefix ``pddw`` by default; tests use their own
  so they never collide with a demo), each with its loopback up;
* a veth pair, ``<prefix>-va`` in A with 10.77.0.1/24 and ``<prefix>-vb`` in B with
  10.77.0.2/24, created straight inside the namespaces (never in the host's);
* optionally a ``tbf`` qdisc at the same rate on both veth ends, so each direction of the WAN
  gets that rate.  This kernel has no ``netem``: latency and jitter come from
  :mod:`pdd_tools.shaper` run inside a namespace.

tbf parameters (see :func:`tbf_params`): ``burst`` is the token bucket depth.  It must hold at
least the largest packet tbf sees, and veth hands it GSO packets of up to 64 KiB (larger ones
are segmented, which costs CPU), and should cover a few timer ticks of the rate or the link
runs below its rate; a deeper bucket only lets a larger burst through after an idle spell.  So
``burst = max(64 KiB + one 1514-byte frame, 4 ms of the rate)``: 66 KiB up to 134 Mbit/s,
125 KB at 250 Mbit/s, 500 KB at 1 Gbit/s.  ``latency 20ms`` bounds the queue: packets that
would wait longer are dropped, as a WAN router with 20 ms of buffer would.  tbf counts whole
frames, so TCP payload gets about 1448/1514 = 95.7% of the rate (measured: 191.5 Mbit/s of
payload at 200 Mbit/s, 959 Mbit/s at 1 Gbit/s).

Everything goes through ``ip`` and ``tc`` (iproute2) with ``check=True``; a failure raises
:class:`NetnsError` showing the command and its stderr.  :meth:`TwoSites.up` needs root and
says so; :meth:`TwoSites.down` is idempotent and also removes what an earlier, crashed run
with the same prefix left behind (``up`` calls it first).  Unless ``keep=True``, ``up``
registers ``down`` with :mod:`atexit`; the CLI turns SIGTERM into a normal exit so that runs.

CLI (``scripts/netns`` wraps it): ``python -m pdd_tools.netns up [--rate-mbit N] [--prefix P]
[--hold]`` (the sites stay up after it exits, unless ``--hold``: then it waits for
SIGTERM/SIGINT and takes them down), ``down [--prefix P]``, ``status [--prefix P]`` (exit 0
when up, 1 when not).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Self

import structlog

__all__ = ["NetnsError", "TwoSites", "main", "tbf_params"]

log = structlog.get_logger("pdd_tools.netns")

SITES = ("a", "b")
ADDRS = {"a": "10.77.0.1", "b": "10.77.0.2"}
PREFIX_LEN = 24
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,11}")  # "<prefix>-va" fits IFNAMSIZ (15)
_GSO_MAX = 64 << 10  # the largest packet veth hands a qdisc (GSO)
_FRAME = 1514  # one Ethernet frame at MTU 1500
_BURST_S = 0.004  # bucket depth: 4 ms of the rate ...
_TBF_LATENCY = "20ms"  # ... and at most 20 ms of queue


class NetnsError(RuntimeError):
    """An ``ip`` / ``tc`` command failed; the message has the command and its stderr."""


def tbf_params(rate_bps: int) -> list[str]:
    """``tc ... tbf`` arguments for ``rate_bps`` bits/s (see the module docstring for why)."""
    if rate_bps <= 0:
        raise ValueError(f"rate must be > 0 bit/s, not {rate_bps}")
    burst = max(_GSO_MAX + _FRAME, int(rate_bps / 8 * _BURST_S))
    return ["rate", f"{rate_bps}bit", "burst", str(burst), "latency", _TBF_LATENCY]


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; on failure raise NetnsError with the command line and its stderr."""
    try:
        return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsError(f"`{argv[0]}` not found: install iproute2") from None
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip() or "no output"
        raise NetnsError(f"`{shlex.join(argv)}` failed (exit {exc.returncode}): {detail}") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{shlex.join(argv)}` did not finish within 30 s") from None


def _netns_names() -> set[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


class TwoSites:
    """Namespaces ``<prefix>-a`` / ``<prefix>-b`` joined by a veth pair; a sync context manager.

    ``rate_bps`` (bits/s) puts a tbf qdisc on both veth ends; None leaves the link unshaped.
    """

    def __init__(self, prefix: str = "pddw", *, rate_bps: int | None = None, keep: bool = False) -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r}: 1-12 characters, letters, digits and _")
        self.prefix = prefix
        self.rate_bps = rate_bps
        self._keep = keep
        self._atexit = False

    # -- names ------------------------------------------------------------

    def ns(self, site: str) -> str:
        """The namespace of ``site`` ("a" or "b", any case)."""
        return f"{self.prefix}-{self._site(site)}"

    def dev(self, site: str) -> str:
        """The veth end inside ``site``'s namespace."""
        return f"{self.prefix}-v{self._site(site)}"

    def addr(self, site: str) -> str:
        """``site``'s address on the WAN (no prefix length)."""
        return ADDRS[self._site(site)]

    def exec_argv(self, site: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``site``'s namespace."""
        return ["ip", "netns", "exec", self.ns(site), *argv]

    @staticmethod
    def _site(site: str) -> str:
        s = site.lower()
        if s not in SITES:
            raise ValueError(f"site must be 'a' or 'b', not {site!r}")
        return s

    def _ip(self, site: str, *args: str) -> None:
        _run(["ip", "-n", self.ns(site), *args])

    # -- lifecycle --------------------------------------------------------

    def exists(self) -> bool:
        """Whether either namespace exists (a live run, or leftovers of a crashed one)."""
        return bool(_netns_names() & {self.ns(s) for s in SITES})

    def up(self) -> None:
        """Create both sites (after removing leftovers with this prefix).  Needs root."""
        if os.geteuid() != 0:
            raise PermissionError(
                f"TwoSites.up() needs root (CAP_NET_ADMIN) to create network namespaces "
                f"{self.ns('a')} and {self.ns('b')}; run it as root, e.g. sudo scripts/netns up"
            )
        self.down()
        if not self._keep and not self._atexit:
            atexit.register(self.down)
            self._atexit = True
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        log.info("sites up", a=self.ns("a"), b=self.ns("b"), rate_bps=self.rate_bps)

    def _create(self) -> None:
        for s in SITES:
            _run(["ip", "netns", "add", self.ns(s)])
        _run(["ip", "link", "add", self.dev("a"), "netns", self.ns("a"), "type", "veth",
              "peer", "name", self.dev("b"), "netns", self.ns("b")])
        for s in SITES:
            self._ip(s, "link", "set", "lo", "up")
            self._ip(s, "addr", "add", f"{self.addr(s)}/{PREFIX_LEN}", "dev", self.dev(s))
            self._ip(s, "link", "set", self.dev(s), "up")
        self.set_rate(self.rate_bps)

    def down(self) -> None:
        """Remove both namespaces (and with them the veth pair).  Idempotent."""
        present = _netns_names()
        removed = []
        for s in SITES:
            if self.ns(s) in present:
                _run(["ip", "netns", "del", self.ns(s)])
                removed.append(self.ns(s))
        for s in SITES:  # a veth end left in the host's namespace by some older run
            if _run(["ip", "link", "show", "dev", self.dev(s)], check=False).returncode == 0:
                _run(["ip", "link", "del", "dev", self.dev(s)])
                removed.append(self.dev(s))
        if self._atexit:
            atexit.unregister(self.down)
            self._atexit = False
        if removed:
            log.info("sites down", removed=removed)

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()

    # -- the link ---------------------------------------------------------

    def set_rate(self, bps: int | None) -> None:
        """Shape both veth ends to ``bps`` bits/s with tbf; None (or 0) removes the shaping."""
        for s in SITES:
            if bps:
                _run(["tc", "-n", self.ns(s), "qdisc", "replace", "dev", self.dev(s), "root", "tbf",
                      *tbf_params(int(bps))])
            elif "tbf" in self.qdisc(s):
                _run(["tc", "-n", self.ns(s), "qdisc", "del", "dev", self.dev(s), "root"])
        self.rate_bps = int(bps) if bps else None

    def qdisc(self, site: str) -> str:
        """``tc qdisc show`` of ``site``'s veth end."""
        return _run(["tc", "-n", self.ns(site), "qdisc", "show", "dev", self.dev(site)]).stdout.strip()

    def link(self, up: bool) -> None:
        """Set both veth ends up or down (down: the WAN route goes, connects fail)."""
        for s in SITES:
            self._ip(s, "link", "set", self.dev(s), "up" if up else "down")

    def status(self) -> list[str]:
        """Human-readable lines: each namespace, its veth address and state, its qdisc."""
        present = _netns_names()
        lines = []
        for s in SITES:
            if self.ns(s) not in present:
                lines.append(f"{self.ns(s)}: absent")
                continue
            res = _run(["ip", "-n", self.ns(s), "-br", "addr", "show", "dev", self.dev(s)], check=False)
            link = res.stdout.strip() or f"{self.dev(s)}: missing"
            qd = self.qdisc(s) if res.returncode == 0 else ""
            lines.append(f"{self.ns(s)}: {link}" + (f"\n  {qd}" if qd else ""))
        return lines


# -- CLI -------------------------------------------------------------------


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds: finally blocks and atexit run


def _prefix(text: str) -> str:
    if not _PREFIX_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: 1-12 characters, letters, digits and _")
    return text


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", type=_prefix, default="pddw", help="namespace name prefix (default pddw)")
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.netns",
                                 description="two network namespaces joined by a veth pair (the WAN)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", parents=[common], help="create the sites (needs root)")
    up.add_argument("--rate-mbit", type=float, help="tbf rate on both veth ends, Mbit/s")
    up.add_argument("--hold", action="store_true", help="stay until SIGTERM/SIGINT, then take them down")
    sub.add_parser("down", parents=[common], help="remove the sites (and leftovers)")
    sub.add_parser("status", parents=[common], help="show them; exit 1 when not up")
    return ap


def _cmd_up(args: argparse.Namespace) -> int:
    if args.rate_mbit is not None and not 0 < args.rate_mbit < 1e6:
        _parser().error("argument --rate-mbit: must be > 0 and < 1e6 (Mbit/s)")
    rate = int(args.rate_mbit * 1e6) if args.rate_mbit else None
    sites = TwoSites(args.prefix, rate_bps=rate, keep=not args.hold)
    sites.up()
    print("\n".join(sites.status()))
    print(f"run in a site: ip netns exec {sites.ns('a')} CMD   (A is {sites.addr('a')}, "
          f"B is {sites.addr('b')})", flush=True)
    if args.hold:
        signal.signal(signal.SIGINT, _on_sigterm)
        try:
            while True:
                signal.pause()
        except SystemExit:
            sites.down()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pdd_wire import log as logmod

    logmod.configure("info")
    signal.signal(signal.SIGTERM, _on_sigterm)
    sites = TwoSites(args.prefix, keep=True)
    try:
        if args.cmd == "up":
            return _cmd_up(args)
        if args.cmd == "down":
            sites.down()
            return 0
        print("\n".join(sites.status()))
        return 0 if all(sites.ns(s) in _netns_names() for s in SITES) else 1
    except (NetnsError, PermissionError) as exc:
        print(f"netns: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
