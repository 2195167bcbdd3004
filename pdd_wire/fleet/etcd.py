"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` on the client port), on aiohttp.

Why not a gRPC client: the maintained asyncio ones (aetcd, etcd3aio) bring grpcio and protobuf,
native wheels several times the size of this daemon, for six calls; aiohttp is already here, and
etcd has served the gateway under ``/v3`` since 3.4 (Debian's etcd-server 3.4.23 in the tests).
What the gateway cannot do, and how this copes: it does not read a *streamed request* (etcd
issue 8237), so a lease is kept alive by one short request per refresh, and a watch is one
request per watch, its answer a stream of JSON lines, cancelled by closing it.

Keys and values are base64 in the gateway's JSON and int64 fields are strings; this module hides
both. Every unary call is bounded by ``request_s``; an endpoint that does not answer (refused,
timed out, ``no leader``) sends the call to the next one, and :class:`EtcdUnavailable` means none
answered.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec

from ..errors import ErrorCode, PddWireError

#: A watch answer larger than this (one JSON line) ends the watch: the caller lists again.
MAX_WATCH_LINE = 32 << 20
_UNAVAILABLE_GRPC = {4, 8, 13, 14}  # DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE


class EtcdError(PddWireError):
    """etcd refused a request (lease not found, bad request, ...)."""

    code = ErrorCode.INTERNAL


class EtcdUnavailable(EtcdError):
    """No endpoint answered within ``request_s`` (or etcd has no leader)."""


class Compacted(EtcdError):
    """A watch asked for revisions etcd has compacted away: list again, then watch."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd compacted its history to revision {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    deleted: bool  # False: put
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchBatch:
    revision: int  # the store's revision this answer is current to
    events: list[Event]


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range of every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # our prefixes end in "/": never 0xff
    return raw.decode()


def _kv(d: dict) -> KeyValue:
    return KeyValue(key=_unb64(d["key"]).decode(errors="replace"), value=_unb64(d.get("value", "")),
                    mod_revision=int(d.get("mod_revision", 0)), lease=int(d.get("lease", 0)))


def _revision(d: dict) -> int:
    return int((d.get("header") or {}).get("revision", 0))


class EtcdClient:
    """``await EtcdClient(["http://127.0.0.1:2379"]).open()``; ``await close()``."""

    def __init__(self, endpoints: list[str], *, ssl_ctx: ssl.SSLContext | None = None,
                 request_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.ssl_ctx = ssl_ctx
        self.request_s = request_s
        self.requests = 0  # every call sent (the benchmark's etcd writes are counted by kind elsewhere)
        self._turn = 0  # the endpoint tried first
        self._http: aiohttp.ClientSession | None = None
        self._decoder = msgspec.json.Decoder()

    async def open(self) -> EtcdClient:
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ssl_ctx or False, limit=64))
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

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
                continue
            answer = self._decoder.decode(raw) if raw else {}
            if status == 200:
                self._turn = (self._turn + i) % len(self.endpoints)
                return answer
            grpc = answer.get("code") if isinstance(answer, dict) else None
            message = (answer.get("message") or answer.get("error") if isinstance(answer, dict)
                       else raw[:200].decode(errors="replace"))
            if status >= 500 and (grpc in _UNAVAILABLE_GRPC or grpc is None):
                last = f"{url}: {message}"
                continue
            raise EtcdError(f"etcd {path}: {message} (HTTP {status})")
        raise EtcdUnavailable(f"etcd unreachable ({last})")

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return int((await self.call("lease/grant", {"TTL": str(ttl_s)}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL now, 0 when etcd no longer has it (expired or revoked)."""
        res = (await self.call("lease/keepalive", {"ID": str(lease)})).get("result") or {}
        return int(res.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _revision(await self.call("kv/put", body))

    async def put_all(self, items: list[tuple[str, bytes]], lease: int = 0) -> int:
        """Several puts in one transaction (one raft write)."""
        ops = [{"request_put": {"key": _b64(k), "value": _b64(v), **({"lease": str(lease)} if lease else {})}}
               for k, v in items]
        return _revision(await self.call("kv/txn", {"success": ops}))

    async def get(self, key: str) -> KeyValue | None:
        kvs = (await self.call("kv/range", {"key": _b64(key)})).get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def delete(self, key: str) -> None:
        await self.call("kv/deleterange", {"key": _b64(key)})

    async def list(self, prefix: str, *, page: int = 1000) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` as of one revision (pages of ``page`` keys); (revision, kvs)."""
        out: list[KeyValue] = []
        start, end, revision = prefix, prefix_end(prefix), 0
        while True:
            body: dict = {"key": _b64(start), "range_end": _b64(end), "limit": str(page)}
            if revision:
                body["revision"] = str(revision)  # every page from the same snapshot
            res = await self.call("kv/range", body)
            revision = revision or _revision(res)
            kvs = [_kv(d) for d in res.get("kvs") or []]
            out += kvs
            if not res.get("more") or not kvs:
                return revision, out
            start = kvs[-1].key + "\0"

    # ------------------------------------------------------------------ watch
    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """Changes under ``prefix`` from ``start_revision`` on, batch by batch, until the stream
        ends (EtcdUnavailable) or is cancelled. The first batch (``events`` empty) says the watch
        is in place. Compacted: ``start_revision`` is gone."""
        http = self._http
        if http is None:
            raise EtcdUnavailable("etcd client is closed")
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        url = self.endpoints[self._turn % len(self.endpoints)]
        try:
            async with asyncio.timeout(self.request_s) as deadline:
                resp = await http.post(f"{url}/v3/watch", json=body,
                                       timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.request_s))
                deadline.reschedule(None)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._turn += 1  # the next try goes elsewhere
            raise EtcdUnavailable(f"etcd watch at {url}: {exc or type(exc).__name__}") from exc
        try:
            if resp.status != 200:
                self._turn += 1
                raise EtcdUnavailable(f"etcd watch at {url}: HTTP {resp.status}")
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                while (i := buf.find(b"\n")) >= 0:
                    line, buf = bytes(buf[:i]), buf[i + 1:]
                    if line.strip():
                        yield self._batch(line)
                if len(buf) > MAX_WATCH_LINE:
                    raise EtcdUnavailable(f"etcd watch answer over {MAX_WATCH_LINE} bytes")
            raise EtcdUnavailable(f"etcd watch at {url} ended")
        except (aiohttp.ClientError, OSError) as exc:
            self._turn += 1
            raise EtcdUnavailable(f"etcd watch at {url}: {exc or type(exc).__name__}") from exc
        finally:
            resp.close()

    def _batch(self, line: bytes) -> WatchBatch:
        msg = self._decoder.decode(line)
        if "error" in msg:
            err = msg["error"]
            raise EtcdUnavailable(f"etcd watch: {err.get('message') if isinstance(err, dict) else err}")
        res = msg.get("result") or {}
        if res.get("compact_revision") and res.get("canceled"):
            raise Compacted(int(res["compact_revision"]))
        if res.get("canceled"):
            raise EtcdUnavailable(f"etcd cancelled the watch: {res.get('cancel_reason', '')}")
        events = [Event(deleted=e.get("type") == "DELETE", kv=_kv(e["kv"])) for e in res.get("events") or []]
        return WatchBatch(revision=_revision(res), events=events)


def client_ssl(ca: str, cert: str, key: str) -> ssl.SSLContext | None:
    """The TLS context for https endpoints: etcd's CA, and the client certificate when etcd
    checks them (``--client-cert-auth``). None without a CA (plain http)."""
    if not ca:
        return None
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx
