"""Configuration: one msgspec Struct tree, read from TOML, every key validated.

A bad file raises :class:`ConfigError` naming the dotted key and the problem; the CLI turns
that into exit status 2. Without a file the agent runs on :func:`default_config`, a two-site
layout on loopback (sites A and B), so ``pdd-wired --site A`` and ``pdd-wired --site B`` on
one machine find each other.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from .errors import INLINE_MAX, MAX_DURATION_S, ConfigError
from .placement import parse_cpus
from .policy import HandoffPolicy, PipelineConfig
from .rundir import default_socket_dir

MiB = 1 << 20
MAX_TOKENS_PER_FRAME = 1 << 20  # limits.max_tokens_per_frame; frames are split to the peer's max_body anyway


class Listen(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    wan: str  # host:port of the WAN listener (control and bulk connections)
    engine_socket: str  # path of the engine Unix socket
    admin: str  # host:port of the admin HTTP server (/metrics, /v1/status); "" disables
    engine_socket_mode: int = 0o600
    engine_uid: int | None = None  # extra uid allowed on the engine socket besides our own (SO_PEERCRED)
    engine_gid: int | None = None  # processes in this group (primary or supplementary) are allowed too


class Peer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    site: str
    node: str
    address: str  # host:port of the peer's WAN listener
    transport: Literal["tcp", "ucx"] = "tcp"
    streams: int | None = None  # bulk connections; None = transfer.streams
    server_name: str | None = None  # name expected in the peer's certificate; None = node
    # "sha256:<hex>" of the peer's certificate (DER): the handshake must present exactly it; "" = any
    # certificate of tls.ca naming the node. Fleet members carry the one they registered.
    fingerprint: str = ""


class Transfer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    chunk_bytes: int = 4 * MiB
    # Chunks to a peer reached over UCX: no checksum pass and no TCP pacing to keep fine-grained,
    # and each chunk costs a rendezvous and a wake-up, so bigger is faster (64 MiB at one transfer
    # at a time: 0.94x bare ucxx against 0.73x with 4 MiB).
    ucx_chunk_bytes: int = 64 * MiB
    # The UCX transports KV to a same-site peer may use (UCX's TLS option; it overrides UCX_TLS).
    # "^tcp": all but tcp (shared memory, RDMA), so no UCX worker listens on a TCP port. "": UCX's
    # own choice (UCX_TLS from the environment, else every transport, tcp included).
    ucx_tls: str = "^tcp"
    streams: int = 4
    credit_bytes: int = 256 * MiB  # unacknowledged KV bytes in flight per peer
    max_transfers: int = 4096  # open transfers per peer and direction
    unposted_wait_s: float = 10.0  # how long incoming KV waits for its receive to be posted
    default_deadline_s: float = 300.0
    post_ttl_s: float = 300.0  # a posted receive no transfer has claimed by then is dropped (engine told)
    prefix_lease_s: float = 30.0  # matched prefix blocks are held this long for the request (prefix_release ends it)
    prefix_query_s: float = 1.0  # without a PREFIX_MATCH by then (or 4 RTTs), every block is sent
    compress: Literal["auto", "on", "off"] = "auto"  # lz4 on WAN chunks; auto: only when it raises goodput
    compress_shuffle: bool = True  # byte-shuffle chunks as 16-bit elements first (fp16/bf16 KV)
    bulk_threads: int = 1  # event-loop threads that carry the bulk connections
    # Offer receives posted for a peer (KV_OFFER, capability offer.v1): its transfer then moves
    # at once instead of waiting a round trip for KV_ACCEPT.
    offers: bool = True
    # Chunks of at most this many bytes go on the control connection itself (capability
    # inline.v1), no more than this many in flight there at once: a small transfer then costs no
    # hop to a bulk thread on either side, and a token frame waits behind at most this much KV.
    # 0: none sent, and inline.v1 not advertised (so none received). At most 64 KiB.
    inline_bytes: int = 64 * 1024


class Limits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    max_body: int = 1 * MiB  # largest control frame body from a peer (engine messages: 16 MiB, proto/engine.md)
    max_engines: int = 64
    max_engines_per_uid: int = 32  # engine connections of one uid: others keep the rest of max_engines
    max_regions: int = 4096  # per engine
    max_tokens_per_frame: int = 8192
    max_peer_connections: int = 64  # inbound WAN connections of authenticated peers at once
    max_handshakes: int = 64  # inbound WAN connections not yet through HELLO / BULK_HELLO (oldest cut first)
    engine_queue_bytes: int = 64 * MiB  # unread events for one engine before it is cut off as stuck
    control_buffer_bytes: int = 64 * MiB  # unsent bytes on a peer's control connection before it is failed
    # Token IDs relayed to one peer and not yet acknowledged (kept for resend), each frame kept
    # counted as 5 more (its own memory): beyond it send_tokens gets LIMIT_EXCEEDED. About 40 bytes
    # of the agent's memory each (2 097 152: ~80 MiB per peer at most).
    max_unacked_tokens: int = 1 << 21


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    connect_s: float = 5.0
    engine_read_s: float = 5.0  # an engine's message, once begun (and a new connection's first), completes by then
    handshake_s: float = 5.0
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0  # silence on the control connection before it is dropped; a stalled flow's bound
    reconnect_max_backoff_s: float = 2.0
    chunk_ack_s: float = 15.0  # a chunk unacknowledged this long is sent again (safety net)
    peer_give_up_s: float = 30.0  # transfers fail once a peer has been unreachable this long
    shutdown_grace_s: float = 10.0
    handoff_s: float = 60.0  # RLD commits a handoff by then or keeps the output (per request: deadline_s)
    handoff_md_margin_s: float = 5.0  # MD's deadline is handoff_s plus this: it rarely races a commit
    loop_stall_warn_s: float = 1.0  # the event loop blocked this long is logged with its stack (0: not watched)


class Tls(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Peers always authenticate: configured certificates (``cert``/``key``/``ca``), else, on
    loopback, a deployment PKI generated in ``auto_dir`` (pdd_wire.pki); plaintext without any
    authentication only with ``allow_plaintext = true`` (logged as a warning at every start)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    auto_dir: str = ""  # generated CA and node certificates; "" = pdd-wire-pki-<uid> beside the engine socket
    # plaintext and unauthenticated: any process that reaches listen.wan can pose as a peer
    allow_plaintext: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mode(self) -> str:
        """"files" (configured certificates), "auto" (generated PKI) or "plaintext"."""
        if self.cert:
            return "files"
        return "plaintext" if self.allow_plaintext else "auto"


class Cpus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Which CPUs the agent's threads run on (pdd_wire.placement), Linux cpulists such as "0-3,8";
    "" = no placement (bulk, with main set: the CPUs the process was started on)."""

    main: str = ""  # the event loop's thread: token, control and engine frames
    bulk: str = ""  # the bulk threads (transfer.bulk_threads) and the other KV work: page-in, copies

    @property
    def main_set(self) -> frozenset[int]:
        return parse_cpus(self.main, "cpus.main")

    @property
    def bulk_set(self) -> frozenset[int]:
        return parse_cpus(self.bulk, "cpus.bulk")


class Policy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """PDD's per-request choices (see pdd_wire.policy for every field)."""

    pipeline: PipelineConfig = PipelineConfig()
    handoff: HandoffPolicy = HandoffPolicy()


class Log(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class EtcdTls(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """TLS to etcd (``https://`` endpoints): the CA etcd's server certificate chains to, and the
    client certificate etcd's ``--client-cert-auth`` checks. "" = none (plain http endpoints)."""

    ca: str = ""
    cert: str = ""
    key: str = ""


class FleetEngine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One engine of this node as the fleet (and the router's pools) see it."""

    role: Literal["P", "RLD", "MD"]
    url: str  # its serving URL (``vllm serve``'s http://host:port)
    engine_socket: str = ""  # the agent socket it uses; "" = listen.engine_socket


class Fleet(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Membership and discovery on etcd (docs/operator.md, "A fleet"). Without ``etcd`` the
    agent knows only its ``[[peers]]`` (the embedded default)."""

    etcd: list[str] = []  # client URLs of the etcd cluster ("http://10.0.0.5:2379"); [] = no fleet
    cluster: str = "pdd"  # the key prefix: /pdd-wire/<cluster>/members/<site>/<node>
    lease_ttl_s: float = 10.0  # a member that stops refreshing disappears after this
    refresh_min_s: float = 10.0  # live figures are re-registered at most this often ...
    refresh_change: float = 0.25  # ... and only when one moved by this fraction (or appeared)
    idle_close_s: float = 60.0  # a fleet peer's session with nothing open this long is closed
    dial_wait_s: float = 10.0  # a first need waits this long for a new session, then fails
    request_s: float = 2.0  # one etcd request (the watch excepted)
    max_members: int = 16384  # records held (each at most 4 KiB of JSON); more are ignored (counted)
    advertise: str = ""  # host:port peers dial (listen.wan when it is a real address)
    transport: Literal["tcp", "ucx"] = "tcp"  # how fleet peers of this site reach this node
    engines: list[FleetEngine] = []
    tls: EtcdTls = EtcdTls()

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    site: str
    node: str
    listen: Listen
    peers: list[Peer] = []
    transfer: Transfer = Transfer()
    cpus: Cpus = Cpus()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    tls: Tls = Tls()
    policy: Policy = Policy()
    log: Log = Log()
    fleet: Fleet = Fleet()

    def peer_sites(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for p in self.peers:
            out.setdefault(p.site, set()).add(p.node)
        return out


#: A site, node or cluster name (proto/README.md, Conventions).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")  # \Z: $ lets a final newline through


def parse_hostport(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(key, f"{value!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """A host to listen on, not to dial: 0.0.0.0 or :: (however written), or none."""
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def dial_address(value: str, key: str) -> tuple[str, int]:
    """``value`` as an address peers can dial (``fleet.advertise``, a member record's ``wan``):
    host:port with neither a wildcard host nor port 0."""
    host, port = parse_hostport(value, key)
    if is_wildcard(host) or port == 0:
        raise ConfigError(key, f"{value!r} is no address peers can dial (a wildcard host, or port 0)")
    return host, port


def engine_url(url: str) -> bool:
    """An engine's serving URL every reader can use: http(s)://host[:port]. One rule for the
    config and the member records read from etcd, so a member is never registered invisible."""
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 -- raises ValueError when out of range
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and not any(c.isspace() for c in url)


def _positive(key: str, value: float) -> None:
    if not value > 0:  # nan too
        raise ConfigError(key, f"must be > 0, got {value}")


def _duration(key: str, value: float, zero: bool = False) -> None:
    """Every duration of the config: more than 0 (or 0, where 0 means off) and at most a week,
    what an engine may ask for too (so neither inf nor nan)."""
    if not (value >= 0 if zero else value > 0) or not value <= MAX_DURATION_S:
        raise ConfigError(key, f"must be {'>= 0' if zero else '> 0'} and at most {MAX_DURATION_S} s "
                               f"(a week), got {value}")


def validate(cfg: Config) -> Config:
    """Checks msgspec's types cannot express; raises ConfigError naming the key."""
    for key, name in (("site", cfg.site), ("node", cfg.node)):
        if not NAME.match(name):
            raise ConfigError(key, f"{name!r} must be 1-63 of [A-Za-z0-9._-], starting alphanumeric")
    parse_hostport(cfg.listen.wan, "listen.wan")
    if cfg.listen.admin:
        parse_hostport(cfg.listen.admin, "listen.admin")
    if not cfg.listen.engine_socket:
        raise ConfigError("listen.engine_socket", "must be a path")
    mode = cfg.listen.engine_socket_mode
    if not 0 <= mode <= 0o777:
        raise ConfigError("listen.engine_socket_mode", "must be a file mode such as 0o600 (384)")
    if mode & 0o600 != 0o600:
        raise ConfigError("listen.engine_socket_mode", f"{mode:#o}: the owner needs read and write (0o600; "
                                                       "0o660 with listen.engine_gid admits a group)")
    for key in ("engine_uid", "engine_gid"):
        ident = getattr(cfg.listen, key)
        if ident is not None and not 0 <= ident < 2**32 - 1:
            raise ConfigError(f"listen.{key}", f"must be a uid/gid 0..4294967294, got {ident}")
    seen = set()
    for i, p in enumerate(cfg.peers):
        for key, name in (("site", p.site), ("node", p.node)):
            if not NAME.match(name):
                raise ConfigError(f"peers[{i}].{key}", f"{name!r} must be 1-63 of [A-Za-z0-9._-]")
        if (p.site, p.node) in seen:
            raise ConfigError(f"peers[{i}]", f"peer {p.site}/{p.node} is listed twice")
        if (p.site, p.node) == (cfg.site, cfg.node):
            raise ConfigError(f"peers[{i}]", "an agent cannot be its own peer")
        seen.add((p.site, p.node))
        parse_hostport(p.address, f"peers[{i}].address")
        if p.streams is not None and not 1 <= p.streams <= 64:
            raise ConfigError(f"peers[{i}].streams", f"must be 1..64, got {p.streams}")
        if p.fingerprint and not FINGERPRINT.match(p.fingerprint):
            raise ConfigError(f"peers[{i}].fingerprint", "must be sha256: and 64 lowercase hex digits")
    t = cfg.transfer
    if not 64 * 1024 <= t.chunk_bytes <= 64 * MiB:
        raise ConfigError("transfer.chunk_bytes", f"must be 64 KiB..64 MiB, got {t.chunk_bytes}")
    if not 1 <= t.streams <= 64:
        raise ConfigError("transfer.streams", f"must be 1..64, got {t.streams}")
    if not 64 * 1024 <= t.ucx_chunk_bytes <= 64 * MiB:
        raise ConfigError("transfer.ucx_chunk_bytes", f"must be 64 KiB..64 MiB, got {t.ucx_chunk_bytes}")
    if t.ucx_tls and not re.fullmatch(r"[\x21-\x7e]{1,256}", t.ucx_tls):
        raise ConfigError("transfer.ucx_tls", f"must be a UCX transport list without whitespace (e.g. \"^tcp\", "
                                              f"\"sm,self\") or \"\" for UCX's own choice, got {t.ucx_tls!r}")
    if not t.chunk_bytes <= t.credit_bytes <= 1 << 48:  # proto/messages.md: credit_bytes on the wire
        raise ConfigError("transfer.credit_bytes", "must be at least transfer.chunk_bytes and at most 2^48")
    if not 0 <= t.inline_bytes <= INLINE_MAX:
        raise ConfigError("transfer.inline_bytes", f"must be 0..{INLINE_MAX} (64 KiB), got {t.inline_bytes}")
    if not 1 <= t.bulk_threads <= 64:
        raise ConfigError("transfer.bulk_threads", f"must be 1..64, got {t.bulk_threads}")
    parse_cpus(cfg.cpus.main, "cpus.main")  # syntax here; whether the host has them, when the agent starts
    parse_cpus(cfg.cpus.bulk, "cpus.bulk")
    for key in ("max_transfers",):
        _positive(f"transfer.{key}", getattr(t, key))
    for key in ("unposted_wait_s", "default_deadline_s", "post_ttl_s", "prefix_lease_s", "prefix_query_s"):
        _duration(f"transfer.{key}", getattr(t, key))
    for f in msgspec.structs.fields(Limits):
        _positive(f"limits.{f.name}", getattr(cfg.limits, f.name))
    if not 4096 <= cfg.limits.max_body <= 16 * MiB:
        raise ConfigError("limits.max_body", "must be 4 KiB..16 MiB")
    if cfg.limits.control_buffer_bytes < 4 * cfg.limits.max_body:
        raise ConfigError("limits.control_buffer_bytes", "must be at least 4 x limits.max_body")
    if cfg.limits.max_tokens_per_frame > MAX_TOKENS_PER_FRAME:
        raise ConfigError("limits.max_tokens_per_frame", f"must be 1..{MAX_TOKENS_PER_FRAME}, "
                                                         f"got {cfg.limits.max_tokens_per_frame}")
    if cfg.limits.max_unacked_tokens < 2 * cfg.limits.max_tokens_per_frame:
        raise ConfigError("limits.max_unacked_tokens", "must be at least 2 x limits.max_tokens_per_frame")
    for f in msgspec.structs.fields(Timeouts):  # loop_stall_warn_s 0: not watched
        _duration(f"timeouts.{f.name}", getattr(cfg.timeouts, f.name), zero=f.name == "loop_stall_warn_s")
    _duration("policy.pipeline.ttft_budget_s", cfg.policy.pipeline.ttft_budget_s, zero=True)
    if cfg.timeouts.dead_after_s <= cfg.timeouts.heartbeat_s:
        raise ConfigError("timeouts.dead_after_s", "must be longer than timeouts.heartbeat_s")
    _validate_fleet(cfg)
    tls = cfg.tls
    for key in ("key", "ca"):
        if getattr(tls, key) and not tls.cert:
            raise ConfigError(f"tls.{key}", "set without tls.cert: mutual TLS with files takes tls.cert, tls.key "
                                            "and tls.ca together (none of them: the generated PKI of tls.auto_dir)")
    if tls.enabled:
        for key in ("cert", "key", "ca"):
            path = getattr(tls, key)
            if not path:
                raise ConfigError(f"tls.{key}", "required when tls.cert is set (mutual TLS)")
            if not os.path.isfile(path):
                raise ConfigError(f"tls.{key}", f"file {path!r} does not exist")
    elif not tls.allow_plaintext:
        addrs = [("listen.wan", cfg.listen.wan)] + [(f"peers[{i}].address", p.address)
                                                   for i, p in enumerate(cfg.peers)]
        if cfg.fleet.advertise:
            addrs.append(("fleet.advertise", cfg.fleet.advertise))
        for key, addr in addrs:
            if not is_loopback(parse_hostport(addr, key)[0]):
                raise ConfigError(key, f"{addr!r} is not loopback: set tls.cert/key/ca (the generated PKI "
                                       "of tls.auto_dir is for agents on one machine), "
                                       "or tls.allow_plaintext = true to accept plaintext on purpose")
    return cfg


def _etcd_url(url: str) -> bool:
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 -- raises ValueError when out of range
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and u.path in ("", "/") and not (u.query or u.fragment)


def validate_etcd(etcd: list[str], tls: EtcdTls, cluster: str, request_s: float, table: str = "fleet") -> None:
    """The etcd part of a ``[fleet]`` table (the agent's, the router's): URLs, TLS, cluster name."""
    for i, url in enumerate(etcd):
        if not _etcd_url(url):
            raise ConfigError(f"{table}.etcd[{i}]", f"{url!r} is not an http(s)://host:port etcd client URL")
        if urlsplit(url).scheme == "https" and not tls.ca:  # urlsplit lower-cases it, as aiohttp reads it
            raise ConfigError(f"{table}.tls.ca", f"required for the https endpoint {url!r} (etcd's server "
                                                 "certificate is checked against it)")
    if etcd and (tls.ca or tls.cert) and not any(urlsplit(u).scheme == "https" for u in etcd):
        raise ConfigError(f"{table}.tls", "set, but no endpoint is https://: the certificates would not be used")
    if not NAME.match(cluster):
        raise ConfigError(f"{table}.cluster", f"{cluster!r} must be 1-63 of [A-Za-z0-9._-]")
    if not 0 < request_s <= 60:
        raise ConfigError(f"{table}.request_s", f"must be in (0, 60], got {request_s}")
    for key in ("ca", "cert", "key"):
        path = getattr(tls, key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{table}.tls.{key}", f"file {path!r} does not exist")
    if bool(tls.cert) != bool(tls.key):
        raise ConfigError(f"{table}.tls.key" if tls.cert else f"{table}.tls.cert", "cert and key go together")


def _validate_fleet(cfg: Config) -> None:
    f = cfg.fleet
    validate_etcd(f.etcd, f.tls, f.cluster, f.request_s)
    _positive("fleet.lease_ttl_s", f.lease_ttl_s)
    for key in ("refresh_min_s", "idle_close_s", "dial_wait_s"):
        if not 0 < getattr(f, key) <= MAX_DURATION_S:  # inf and nan too: a session never dropped
            raise ConfigError(f"fleet.{key}", f"must be in (0, {MAX_DURATION_S}] s, got {getattr(f, key)}")
    if not 2 <= f.lease_ttl_s <= 3600 or not float(f.lease_ttl_s).is_integer():
        raise ConfigError("fleet.lease_ttl_s", f"must be 2..3600 s (whole seconds in etcd), got {f.lease_ttl_s}")
    # A keep-alive goes out every third of the TTL and may try every endpoint but the one that
    # answers before it lands: that must fit in the two thirds left, or one dead endpoint costs the lease.
    if (len(f.etcd) - 1) * f.request_s >= f.lease_ttl_s * 2 / 3:
        raise ConfigError("fleet.request_s", f"{f.request_s:g} s x {len(f.etcd) - 1} other endpoints does not fit "
                                             f"in 2/3 of fleet.lease_ttl_s ({f.lease_ttl_s:g} s): a dead endpoint "
                                             "would cost the lease; lower request_s or raise lease_ttl_s")
    if not 0 <= f.refresh_change <= 10:
        raise ConfigError("fleet.refresh_change", f"must be 0..10 (a fraction), got {f.refresh_change}")
    if not 1 <= f.max_members <= 1 << 20:
        raise ConfigError("fleet.max_members", f"must be 1..1048576, got {f.max_members}")
    if f.advertise:
        dial_address(f.advertise, "fleet.advertise")
    elif f.enabled and is_wildcard(parse_hostport(cfg.listen.wan, "listen.wan")[0]):  # its port: the one bound
        raise ConfigError("fleet.advertise", f"required: listen.wan {cfg.listen.wan!r} is no address peers can dial")
    for i, e in enumerate(f.engines):
        if not engine_url(e.url):
            raise ConfigError(f"fleet.engines[{i}].url", f"{e.url!r} is not an http(s)://host:port URL")


#: A certificate fingerprint as peers[].fingerprint and fleet records carry it.
FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")
_KEY = re.compile(r"at `\$(.*?)`")


def _key_of(msg: str) -> str:
    m = _KEY.search(msg)
    path = m.group(1) if m else ""
    unknown = re.search(r"unknown field `([^`]+)`", msg)
    if unknown:
        path = f"{path}.{unknown.group(1)}"
    missing = re.search(r"missing required field `([^`]+)`", msg)
    if missing:
        path = f"{path}.{missing.group(1)}"
    return path.lstrip(".") or "(top level)"


def _type_at(key: str):
    """The type a dotted config key (``peers[0].transport``) has in :class:`Config`, or None."""
    t: Any = Config
    for part in re.sub(r"\[\d+\]", "", key).split("."):
        if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
            return None
        t = {f.name: f.type for f in msgspec.structs.fields(t)}.get(part)
        # list[Peer] -> Peer, int | None -> int
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (list, typing.Union, types.UnionType) and len(args) == 1:
            t = args[0]
    return t


def _hint(key: str, msg: str) -> str:
    """``; did you mean 'chunk_bytes'?`` for an unknown key, the valid values for an enum."""
    parent, _, leaf = key.rpartition(".")
    if "unknown field" in msg:
        t = _type_at(parent) if parent else Config
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            names = [f.name for f in msgspec.structs.fields(t)]
            close = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
            if close:
                return f"; did you mean {' or '.join(repr(c) for c in close)}?"
            return f"; valid keys here: {', '.join(names)}"
    if "Invalid enum value" in msg:
        t = _type_at(key)
        if typing.get_origin(t) is Literal:
            return f"; valid values: {', '.join(repr(v) for v in typing.get_args(t))}"
    return ""


def loads(text: str | bytes, *, overrides: dict | None = None) -> Config:
    """Parse TOML text; ``overrides`` (e.g. from the CLI) replace top-level keys."""
    try:
        raw = msgspec.toml.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError("(file)", f"not valid TOML: {exc}") from exc
    if overrides:
        raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        key, problem = _key_of(msg), msg.split(" - at ")[0]
        # A struct's own check ("ttft_budget_s: must be ...", pdd_wire.policy) names its field.
        field = re.match(r"([a-z_]+): (.*)", problem, re.S)
        t = _type_at(key) if field else None
        if field and isinstance(t, type) and issubclass(t, msgspec.Struct) and field.group(1) in t.__struct_fields__:
            key, problem = f"{key}.{field.group(1)}", field.group(2)
        raise ConfigError(key, problem + _hint(key, msg)) from exc
    return validate(cfg)


def load(path: str | Path, **kw) -> Config:
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError("(file)", f"cannot read {str(path)!r}: {exc.strerror}") from exc
    return loads(text, **kw)


# Two sites on loopback. Ports 7601.. (WAN) and 7701.. (admin); the engine sockets live in
# $XDG_RUNTIME_DIR, or /tmp when that is unset.
DEFAULT_SITES = {"A": ("a1", 7601, 7701), "B": ("b1", 7602, 7702)}

DEFAULT_TEMPLATE = """\
# pdd-wire embedded default: sites A and B on one machine, over loopback, mutual TLS with a
# deployment CA and node certificates generated on first start (tls.auto_dir).
site = "{site}"
node = "{node}"

[listen]
wan = "127.0.0.1:{wan}"
admin = "127.0.0.1:{admin}"
# /run/pdd-wire: the systemd unit's RuntimeDirectory (docs/operator.md). pdd-wired run without
# --config puts it in $XDG_RUNTIME_DIR (else /tmp/pdd-wire-<uid>) instead.
engine_socket = "{sock}"

{peers}
[transfer]
chunk_bytes = 4194304
streams = 4

# A node with cores to spare: bulk threads off the cores of the main loop and the engines, so a
# token never waits for a core behind a large transfer (docs/operator.md, "CPU placement").
# [cpus]
# main = "0"
# bulk = "2-5"

# Many nodes: let them find each other in etcd instead of listing [[peers]] (docs/operator.md,
# "A fleet"); sessions then open on first need and close when idle.
# [fleet]
# etcd = ["http://127.0.0.1:2379"]
# cluster = "pdd"
# [[fleet.engines]]
# role = "P"
# url = "http://127.0.0.1:8100"
"""


def default_engine_socket(site: str) -> str:
    """The engine socket of ``pdd-wired --site SITE`` run without ``--config``, found the way
    the daemon finds it (``$XDG_RUNTIME_DIR``, else ``/tmp/pdd-wire-<uid>``)."""
    return os.path.join(default_socket_dir(), f"pdd-wire-{site}.sock")


def default_toml(site: str, *, for_file: bool = False) -> str:
    """The embedded default of ``site``; ``for_file`` (``pdd-wire config``): a starting point for
    a file, its engine socket where the systemd unit and the guide put it (/run/pdd-wire)."""
    if site not in DEFAULT_SITES:
        raise ConfigError("site", f"{site!r} has no embedded default (known: {sorted(DEFAULT_SITES)}); " + (
            "start from one of them (pdd-wire config --site A > FILE) and run pdd-wired --config FILE"
            if for_file else "pass --config FILE"))
    node, wan, admin = DEFAULT_SITES[site]
    peers = "".join(
        f'[[peers]]\nsite = "{s}"\nnode = "{n}"\naddress = "127.0.0.1:{w}"\ntransport = "tcp"\n\n'
        for s, (n, w, _) in DEFAULT_SITES.items() if s != site)
    sock = f"/run/pdd-wire/pdd-wire-{site}.sock" if for_file else default_engine_socket(site)
    return DEFAULT_TEMPLATE.format(site=site, node=node, wan=wan, admin=admin, sock=sock, peers=peers)


def default_config(site: str, **overrides) -> Config:
    return loads(default_toml(site), overrides=overrides)
