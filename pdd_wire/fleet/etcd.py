"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` on the client port), on aiohttp.

Why not a gRPC client: the maintained asyncio ones (aetcd, etcd3aio) bring grpcio and protobuf,
native wheels several times the size of this daemon, for six calls; aiohttp is already here, and
etcd has served the gateway under ``/v3`` since 3.4 (Debian's etcd-server 3.4.23 in the tests).
What the gateway cannot do, and how this copes: it does not read a *streamed request* (etcd
issue 8237), so a lease is kept alive by one short request per refresh, and a watch is one
request per watch, its answer a stream of JSON lines, cancelled by closing it.

Keys and values are base64 in the gateway's JSON and int64 fields are strings; this module hides
both. Every unary call is bounded by ``request_s``; an endpoint that does not answer (refused,
timed out, ``no leader``, an answer that is not etcd's JSON) sends the call to the next one, and
:class:`EtcdUnavailable` means none answered.

A watch must not go quiet unnoticed (a silent stream looks like a quiet fleet). Three things end
one that can no longer deliver: etcd's *require leader* (``Grpc-Metadata-hasleader``: the member
ends its watches when it loses its leader), TCP keep-alive on the stream's socket (a dead host or
path), and any unary call of this client that finds the watch's endpoint not answering (a frozen
or overloaded member: its watches are ended at once, and resumed elsewhere by the caller).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import aiohttp
import msgspec

from ..errors import ErrorCode, PddWireError

#: A watch answer larger than this (one JSON line) ends the watch: the caller lists again.
MAX_WATCH_LINE = 32 << 20
_UNAVAILABLE_GRPC = {4, 8, 13, 14}  # DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE
#: TCP keep-alive of a watch stream: probes after this much silence, this often, this many.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
_COMPACTED = "required revision has been compacted"


class EtcdError(PddWireError):
    """etcd refused a request (lease not found, bad request, ...)."""

    code = ErrorCode.INTERNAL


class EtcdUnavailable(EtcdError):
    """No endpoint answered within ``request_s`` (or etcd has no leader, or what answered is
    not etcd)."""


class Compacted(EtcdError):
    """A watch or a read asked for revisions etcd has compacted away: list again, then watch."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd compacted its history (to revision {compact_revision or 'unknown'})")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int  # for a delete event: the revision of the delete
    lease: int
    create_revision: int = 0


@dataclass(frozen=True, slots=True)
class Event:
    deleted: bool  # False: put
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchBatch:
    revision: int  # the store's revision this answer is current to
    events: list[Event]
    cluster_id: str = ""  # the etcd cluster that answered (another one: a new store)


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s, validate=True)


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range of every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # our prefixes end in "/": never 0xff
    return raw.decode()


def _kv(d: dict) -> KeyValue:
    return KeyValue(key=_unb64(d["key"]).decode(errors="replace"), value=_unb64(d.get("value", "")),
                    mod_revision=int(d.get("mod_revision", 0)), lease=int(d.get("lease", 0)),
                    create_revision=int(d.get("create_revision", 0)))


def _header(d: dict) -> dict:
    """An answer's header (a keep-alive's is in its ``result``); {} when it has none."""
    h = d.get("header")
    if not isinstance(h, dict) and isinstance(d.get("result"), dict):
        h = d["result"].get("header")
    return h if isinstance(h, dict) else {}


def _revision(d: dict) -> int:
    return int(_header(d).get("revision", 0))


class EtcdClient:
    """``await EtcdClient(["http://127.0.0.1:2379"]).open()``; ``await close()``.

    ``ssl_ctx``: the TLS context for ``https://`` endpoints; None verifies them against the
    system's CAs (never: no verification)."""

    def __init__(self, endpoints: list[str], *, ssl_ctx: ssl.SSLContext | None = None,
                 request_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.ssl_ctx = ssl_ctx
        self.request_s = request_s
        self.requests = 0  # every call sent (the benchmark's etcd writes are counted by kind elsewhere)
        self.list_page = 1000  # keys per range request of a listing
        self.cluster_id = ""  # of the last answer (a new one: the store was replaced)
        self._turn = 0  # the endpoint tried first
        self._http: aiohttp.ClientSession | None = None
        self._decoder = msgspec.json.Decoder()
        self._watching: dict[str, set[asyncio.Future]] = {}  # endpoint -> the open watches' stall signals
        self.failed_at: dict[str, float] = {}  # endpoint -> when it last failed a call (monotonic)

    async def open(self) -> EtcdClient:
        if self._http is None:
            # ssl: the context, else True (the default verification); never False (none at all)
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                ssl=self.ssl_ctx if self.ssl_ctx is not None else True, limit=64))
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _failed(self, url: str) -> None:
        """``url`` did not answer a call: the watches open on it cannot be trusted either."""
        self.failed_at[url] = time.monotonic()
        for stall in self._watching.get(url, ()):
            if not stall.done():
                stall.set_result(None)

    @contextlib.contextmanager
    def _parsing(self, what: str):
        """An answer of the wrong shape comes from an endpoint that is not (a working) etcd: the
        next call goes to another one."""
        try:
            yield
        except (KeyError, ValueError, TypeError, AttributeError, binascii.Error) as exc:
            self._turn += 1
            raise EtcdUnavailable(f"etcd {what}: an answer of the wrong shape ({type(exc).__name__}: {exc})") from exc

    def _move_from(self, url: str) -> None:
        """The next call or watch goes to another endpoint than ``url`` (if it was next)."""
        if self.endpoints[self._turn % len(self.endpoints)] == url:
            self._turn += 1

    def _decode(self, raw: bytes):
        try:
            return self._decoder.decode(raw) if raw else {}
        except msgspec.DecodeError:
            return None

    # ------------------------------------------------------------------ unary calls
    async def call(self, path: str, body: dict) -> dict:
        """POST ``/v3/<path>`` to the first endpoint that answers; its JSON answer."""
        http = self._http
        if http is None:
            raise EtcdUnavailable("etcd client is closed")
        last = "no endpoint"
        for i in range(len(self.endpoints)):
            url = self.endpoints[(self._turn + i) % len(self.endpoints)]
            self.requests += 1
            try:
                async with asyncio.timeout(self.request_s):
                    async with http.post(f"{url}/v3/{path}", json=body) as r:
                        raw = await r.read()
                        status = r.status
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                last = f"{url}: {exc or type(exc).__name__}"
                self._failed(url)
                continue
            answer = self._decode(raw)
            if not isinstance(answer, dict) or (status == 200 and not _header(answer)):
                # not etcd (a proxy's error page, another service): every answer of etcd's has a header
                last = f"{url}: HTTP {status}, not etcd's answer: {raw[:120].decode(errors='replace')!r}"
                self._failed(url)
                continue
            if status == 200:
                self._turn = (self._turn + i) % len(self.endpoints)
                self.cluster_id = str(_header(answer).get("cluster_id", "")) or self.cluster_id
                return answer
            grpc = answer.get("code")
            message = str(answer.get("message") or answer.get("error") or "")
            if status >= 500 and (grpc in _UNAVAILABLE_GRPC or grpc is None):
                last = f"{url}: {message}"
                self._failed(url)
                continue
            if _COMPACTED in message:
                raise Compacted(0)
            raise EtcdError(f"etcd {path}: {message} (HTTP {status})")
        raise EtcdUnavailable(f"etcd unreachable ({last})")

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        answer = await self.call("lease/grant", {"TTL": str(ttl_s)})
        with self._parsing("lease/grant"):
            return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL now, 0 when etcd no longer has it (expired or revoked)."""
        answer = await self.call("lease/keepalive", {"ID": str(lease)})
        with self._parsing("lease/keepalive"):
            return int((answer.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    async def leases(self) -> list[int]:
        """Every lease etcd holds now (all clients')."""
        answer = await self.call("lease/leases", {})
        with self._parsing("lease/leases"):
            return [int(x["ID"]) for x in answer.get("leases") or []]

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.call("kv/put", body)
        with self._parsing("kv/put"):
            return _revision(answer)

    @staticmethod
    def _puts(items: list[tuple[str, bytes]], lease: int) -> list[dict]:
        return [{"request_put": {"key": _b64(k), "value": _b64(v), **({"lease": str(lease)} if lease else {})}}
                for k, v in items]

    async def put_all(self, items: list[tuple[str, bytes]], lease: int = 0) -> int:
        """Several puts in one transaction (one raft write)."""
        answer = await self.call("kv/txn", {"success": self._puts(items, lease)})
        with self._parsing("kv/txn"):
            return _revision(answer)

    async def put_all_if(self, items: list[tuple[str, bytes]], lease: int, *, guard: str, guard_lease: int = 0,
                         guard_mod: int = 0) -> tuple[bool, int, KeyValue | None]:
        """The puts of :meth:`put_all` in one transaction, only if ``guard`` is absent (neither
        given), bound to ``guard_lease``, or last written at revision ``guard_mod`` (unchanged
        since it was read). (done, revision, the guard key as it is when not done: None if it is
        absent)."""
        compare = ({"key": _b64(guard), "target": "MOD", "result": "EQUAL", "mod_revision": str(guard_mod)}
                   if guard_mod else
                   {"key": _b64(guard), "target": "LEASE", "result": "EQUAL", "lease": str(guard_lease)}
                   if guard_lease else
                   {"key": _b64(guard), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
        answer = await self.call("kv/txn", {"compare": [compare], "success": self._puts(items, lease),
                                            "failure": [{"request_range": {"key": _b64(guard)}}]})
        with self._parsing("kv/txn"):
            if answer.get("succeeded"):
                return True, _revision(answer), None
            responses = answer.get("responses") or [{}]
            kvs = (responses[0].get("response_range") or {}).get("kvs") or []
            return False, _revision(answer), _kv(kvs[0]) if kvs else None

    async def get(self, key: str) -> KeyValue | None:
        answer = await self.call("kv/range", {"key": _b64(key)})
        with self._parsing("kv/range"):
            kvs = answer.get("kvs") or []
            return _kv(kvs[0]) if kvs else None

    async def delete(self, key: str) -> None:
        await self.call("kv/deleterange", {"key": _b64(key)})

    async def list(self, prefix: str, *, page: int | None = None) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` as of one revision (pages of ``page`` keys); (revision, kvs).
        Compacted: etcd compacted that revision away between two pages (list again)."""
        out: list[KeyValue] = []
        page = page or self.list_page
        start, end, revision = prefix, prefix_end(prefix), 0
        while True:
            body: dict = {"key": _b64(start), "range_end": _b64(end), "limit": str(page)}
            if revision:
                body["revision"] = str(revision)  # every page from the same snapshot
            res = await self.call("kv/range", body)
            with self._parsing("kv/range"):
                revision = revision or _revision(res)
                kvs = [_kv(d) for d in res.get("kvs") or []]
            out += kvs
            if not res.get("more") or not kvs:
                return revision, out
            start = kvs[-1].key + "\0"

    # ------------------------------------------------------------------ watch
    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        """Changes under ``prefix`` from ``start_revision`` on, batch by batch, until the stream
        ends (EtcdUnavailable) or is cancelled. The first batch (``events`` empty) says the watch
        is in place. Compacted: ``start_revision`` is gone. A call of this client that finds
        the watch's endpoint not answering ends the watch (EtcdUnavailable)."""
        http = self._http
        if http is None:
            raise EtcdUnavailable("etcd client is closed")
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        url = self.endpoints[self._turn % len(self.endpoints)]
        stall = asyncio.get_running_loop().create_future()
        watching = self._watching.setdefault(url, set())
        watching.add(stall)
        read: asyncio.Future | None = None
        try:
            try:
                async with asyncio.timeout(self.request_s) as deadline:
                    resp = await http.post(f"{url}/v3/watch", json=body, headers={"Grpc-Metadata-hasleader": "true"},
                                           timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.request_s))
                    deadline.reschedule(None)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self._move_from(url)
                self._failed(url)
                raise EtcdUnavailable(f"etcd watch at {url}: {exc or type(exc).__name__}") from exc
            try:
                if resp.status != 200:
                    raise EtcdUnavailable(f"etcd watch at {url}: HTTP {resp.status}")
                _keepalive(resp)
                buf = bytearray()
                while True:
                    read = asyncio.ensure_future(resp.content.readany())
                    await asyncio.wait((read, stall), return_when=asyncio.FIRST_COMPLETED)
                    if not read.done():
                        raise EtcdUnavailable(f"etcd watch at {url}: the endpoint stopped answering calls")
                    chunk = read.result()
                    read = None
                    if not chunk:
                        raise EtcdUnavailable(f"etcd watch at {url} ended")
                    buf += chunk
                    while (i := buf.find(b"\n")) >= 0:
                        line, buf = bytes(buf[:i]), buf[i + 1:]
                        if line.strip():
                            yield self._batch(line)
                    if len(buf) > MAX_WATCH_LINE:
                        raise EtcdUnavailable(f"etcd watch answer over {MAX_WATCH_LINE} bytes")
            except (aiohttp.ClientError, OSError) as exc:
                self._move_from(url)
                raise EtcdUnavailable(f"etcd watch at {url}: {exc or type(exc).__name__}") from exc
            except EtcdUnavailable:  # it ended, cancelled, answered no watch, or stopped answering
                self._move_from(url)
                raise
            finally:
                resp.close()
        finally:
            if read is not None and not read.done():
                read.cancel()
            watching.discard(stall)
            if not watching:
                self._watching.pop(url, None)

    def _batch(self, line: bytes) -> WatchBatch:
        msg = self._decode(line)
        if not isinstance(msg, dict):
            raise EtcdUnavailable(f"etcd watch: a line that is not etcd's JSON: "
                                  f"{line[:120].decode(errors='replace')!r}")
        if "error" in msg:
            err = msg["error"]
            raise EtcdUnavailable(f"etcd watch: {err.get('message') if isinstance(err, dict) else err}")
        with self._parsing("watch"):
            res = msg["result"]
            int(res["header"]["revision"])  # every answer of a watch has one: else this is not etcd
            if res.get("compact_revision") and res.get("canceled"):
                raise Compacted(int(res["compact_revision"]))
            if res.get("canceled"):
                raise EtcdUnavailable(f"etcd cancelled the watch: {res.get('cancel_reason', '')}")
            events = [Event(deleted=e.get("type") == "DELETE", kv=_kv(e["kv"])) for e in res.get("events") or []]
            return WatchBatch(revision=_revision(res), events=events,
                              cluster_id=str(_header(res).get("cluster_id", "")))


def _keepalive(resp: aiohttp.ClientResponse) -> None:
    """TCP keep-alive on a watch stream's socket: a dead host or path ends the stream."""
    conn = resp.connection
    sock = conn.transport.get_extra_info("socket") if conn is not None and conn.transport is not None else None
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


def client_ssl(ca: str, cert: str, key: str) -> ssl.SSLContext | None:
    """The TLS context for https endpoints: etcd's CA (the system's CAs without one), and the
    client certificate when etcd checks them (``--client-cert-auth``). None when neither is
    given (the default verification)."""
    if not ca and not cert:
        return None
    ctx = ssl.create_default_context(cafile=ca or None)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx
