"""What one fleet member says about itself in etcd: its keys, its records, their bounds, and
when they are written again. Pure: no I/O, no clock (callers pass the times).

Layout, under one prefix per cluster (``fleet.cluster``), both keys bound to the member's lease::

    /pdd-wire/<cluster>/members/<site>/<node>   MemberRecord: who it is, where, what it runs
    /pdd-wire/<cluster>/live/<site>/<node>      LiveRecord: its load and link estimates

Two keys because they change at different rates and interest different readers: every agent
watches ``members/`` (it changes when a member joins, leaves or restarts), so a live figure
written by one member is not sent to every other one of thousands; only who needs load (the
router) watches ``live/``. Both are written in one transaction at registration.

A record is at most :data:`MAX_RECORD_BYTES` (a member writing more is refused by its own agent;
a bigger one read from etcd is ignored and counted). Live figures are written again only when
:func:`should_refresh` says so: at most once per ``fleet.refresh_min_s`` and only when one
figure moved by ``fleet.refresh_change`` (a fraction) or a link appeared or went. So a quiet
fleet of N members writes nothing but lease keep-alives (N / (ttl/3) a second, which etcd's
leader answers without a raft write), and a busy one at most N / refresh_min_s puts a second.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..config import FINGERPRINT, NAME, dial_address, engine_url, parse_hostport
from ..errors import ConfigError

KEY_ROOT = "/pdd-wire/"
RECORD_VERSION = 1
#: One record, JSON-encoded. 60 links at ~60 bytes and four engines fit in it easily; etcd's own
#: limit on a request is 1.5 MiB, ours keeps a 10,000-member listing near 40 MB at most.
MAX_RECORD_BYTES = 4096
#: Link estimates a record carries: the busiest ones (by bandwidth), at most this many.
MAX_LINKS = 16

# What a figure must at least differ by before its relative change counts (noise around zero):
# transfers 1, queue 1 MiB, bandwidth 1 MB/s, RTT 1 ms.
_FLOORS = {"transfers": 1.0, "queue_bytes": float(1 << 20), "engines": 1.0}
_LINK_FLOORS = {"bandwidth_Bps": 1e6, "rtt_s": 1e-3}


class RecordError(ValueError):
    """A record read from etcd that is not one (too big, not JSON of this shape, wrong key, a
    field out of range)."""


class EngineRec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str  # "P", "RLD" or "MD"
    url: str  # its serving URL (vllm serve)
    engine_socket: str = ""  # the agent's engine socket it uses, on that node
    admin: str = ""  # that agent's admin host:port


class LinkRec(msgspec.Struct, frozen=True, array_like=True):
    peer: str  # "site/node"
    bandwidth_Bps: float
    rtt_s: float


class Live(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Figures the agent has anyway: its load and its link estimates."""

    transfers: int = 0  # open transfers, both directions
    queue_bytes: int = 0  # KV bytes accepted and not yet acknowledged, all peers
    engines: int = 0  # engine connections on its socket
    links: tuple[LinkRec, ...] = ()


class MemberRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One member. Unknown fields are ignored (a newer agent may add some); ``v`` changes only
    for a change an older reader must not misread. Written once per lease (registration)."""

    v: int = RECORD_VERSION
    site: str
    node: str
    incarnation: int  # the agent process (HELLO's incarnation): a new one means it restarted
    wan: str  # host:port its peers dial (control and bulk connections)
    transport: str = "tcp"  # how members of its own site reach it: "tcp" or "ucx" (the UCX worker
    #                         address itself is per session: HELLO.ucx_address)
    # No name for its certificate: the certificate must name the node (a name taken from etcd would
    # let whoever writes etcd make one member's certificate pass for another's).
    fingerprint: str = ""  # "sha256:<hex>" of its certificate (DER); "" = plaintext
    versions: tuple[int, ...] = ()  # protocol versions it speaks (HELLO.versions)
    capabilities: tuple[str, ...] = ()
    admin: str = ""  # its admin host:port ("" none)
    engines: tuple[EngineRec, ...] = ()
    at: float = 0.0  # wall-clock time of the registration (seconds since the epoch)

    @property
    def key(self) -> str:
        return f"{self.site}/{self.node}"


class LiveRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One member's live figures, written again under the refresh rule."""

    v: int = RECORD_VERSION
    site: str
    node: str
    live: Live = Live()
    at: float = 0.0  # wall-clock time of this write

    @property
    def key(self) -> str:
        return f"{self.site}/{self.node}"


def members_prefix(cluster: str) -> str:
    return f"{KEY_ROOT}{cluster}/members/"


def live_prefix(cluster: str) -> str:
    return f"{KEY_ROOT}{cluster}/live/"


def member_key(cluster: str, site: str, node: str) -> str:
    return f"{members_prefix(cluster)}{site}/{node}"


def live_key(cluster: str, site: str, node: str) -> str:
    return f"{live_prefix(cluster)}{site}/{node}"


def _trimmed(rec: MemberRecord | LiveRecord) -> MemberRecord | LiveRecord:
    if not isinstance(rec, LiveRecord) or len(rec.live.links) <= MAX_LINKS:
        return rec
    busiest = tuple(sorted(rec.live.links, key=lambda lk: -lk.bandwidth_Bps)[:MAX_LINKS])
    return msgspec.structs.replace(rec, live=msgspec.structs.replace(rec.live, links=busiest))


def encode(rec: MemberRecord | LiveRecord) -> bytes:
    """The record as written (links trimmed to :data:`MAX_LINKS`); ValueError past the size bound."""
    raw = msgspec.json.encode(_trimmed(rec))
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"member record of {len(raw)} bytes, over {MAX_RECORD_BYTES}: fewer engines, "
                         "or shorter URLs")
    return raw


#: A wall-clock ``at`` as long as JSON writes one (18 characters, until 2286): what a record's
#: size is checked with before it is written.
LONGEST_AT = 4102444800.0000005


def check_size(me: MemberRecord) -> None:
    """ValueError naming the bound when ``me`` would not fit once registered (with the ``at``
    of a registration, which varies, at its longest)."""
    encode(msgspec.structs.replace(me, at=LONGEST_AT))


_decoders: dict[type, Any] = {MemberRecord: msgspec.json.Decoder(MemberRecord),
                              LiveRecord: msgspec.json.Decoder(LiveRecord)}


def decode(key: str, raw: bytes, prefix: str, kind: type = MemberRecord):
    """The record (a ``kind``) stored at ``key`` under ``prefix``; RecordError naming what is wrong."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{key}: {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        rec = _decoders[kind].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # (nested too deep: 2 KB)
        raise RecordError(f"{key}: not a {kind.__name__} ({exc})") from exc
    if rec.v != RECORD_VERSION:
        raise RecordError(f"{key}: record version {rec.v}, this agent reads {RECORD_VERSION}")
    if key != f"{prefix}{rec.site}/{rec.node}":
        raise RecordError(f"{key}: the record names {rec.site}/{rec.node}, not its key")
    for name, value in (("site", rec.site), ("node", rec.node)):
        if not NAME.match(value):
            raise RecordError(f"{key}: {name} {value!r} is not 1-63 of [A-Za-z0-9._-]")
    if isinstance(rec, MemberRecord):
        _check_member(key, rec)
    return rec


_ROLES = ("P", "RLD", "MD")


def _check_member(key: str, rec: MemberRecord) -> None:
    """Every field a reader acts on is in range (RecordError naming it): a record is input."""
    if not 1 <= rec.incarnation < 1 << 63:
        raise RecordError(f"{key}: incarnation {rec.incarnation} is not 1..2^63-1")
    try:
        dial_address(rec.wan, "wan")  # fleet.advertise's rule: a wildcard or port 0 reaches no one
    except ConfigError as exc:
        raise RecordError(f"{key}: wan {rec.wan!r} is not a host:port peers can dial") from exc
    if rec.transport not in ("tcp", "ucx"):
        raise RecordError(f"{key}: transport {rec.transport!r} is not tcp or ucx")
    if rec.fingerprint and not FINGERPRINT.match(rec.fingerprint):
        raise RecordError(f"{key}: fingerprint {rec.fingerprint!r} is not sha256: and 64 lowercase hex digits")
    if rec.admin:
        try:
            parse_hostport(rec.admin, "admin")
        except ConfigError as exc:
            raise RecordError(f"{key}: admin {rec.admin!r} is not host:port") from exc
    for i, e in enumerate(rec.engines):
        if e.role not in _ROLES or not engine_url(e.url):  # fleet.engines[].url's rule
            raise RecordError(f"{key}: engines[{i}] ({e.role!r}, {e.url!r}) is not a role of {_ROLES} "
                              "with an http(s)://host:port URL")


def _moved(a: float, b: float, floor: float, change: float) -> bool:
    return abs(a - b) > change * max(abs(a), abs(b), floor)


def figures_moved(last: Live, new: Live, change: float) -> bool:
    """One figure of ``new`` differs from ``last`` by more than ``change`` (relative), or the
    set of links is not the same."""
    for name, floor in _FLOORS.items():
        if _moved(getattr(last, name), getattr(new, name), floor, change):
            return True
    old = {lk.peer: lk for lk in last.links}
    if set(old) != {lk.peer for lk in new.links}:
        return True
    return any(_moved(getattr(old[lk.peer], f), getattr(lk, f), floor, change)
               for lk in new.links for f, floor in _LINK_FLOORS.items())


def should_refresh(last: Live, new: Live, since_s: float, *, min_s: float, change: float) -> bool:
    """Write the live figures again now? ``since_s``: seconds since the last write."""
    return since_s >= min_s and figures_moved(last, new, change)
