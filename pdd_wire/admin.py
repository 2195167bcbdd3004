"""The admin HTTP server (aiohttp): /healthz, /readyz, /metrics, /v1/status, /v1/probe.

It reads the agent through :class:`AdminSource`, the few things these pages show, and imports
nothing of the agent.
"""

from __future__ import annotations

import os
from typing import Protocol

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ._version import __version__
from .config import parse_hostport
from .errors import ErrorCode, PddWireError


class AdminSource(Protocol):
    """What the admin pages read (the agent implements it)."""

    def is_ready(self) -> bool: ...
    def peers_up(self) -> tuple[int, int]: ...  # (up, configured)
    def metrics_text(self) -> bytes: ...
    def describe(self) -> dict: ...
    async def probe(self, peer: str, seconds: float, streams: int | None) -> dict: ...


class AdminServer:
    def __init__(self, listen: str, source: AdminSource) -> None:
        self.listen = listen
        self.source = source
        self.address: str | None = None
        self._runner: web.AppRunner | None = None
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/status", self.status)
        app.router.add_post("/v1/probe", self.probe)
        self.app = app

    async def start(self) -> None:
        host, port = parse_hostport(self.listen, "listen.admin")
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        h, p = self._runner.addresses[0][:2]
        self.address = f"{h}:{p}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: the event loop answers."""
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready means listening: listeners bound and not stopping (200, else 503). Peers being
        down does not make an agent unready (its engines still get clear errors); the body says
        how many are up, and ``/readyz?peers=all`` answers 200 only when every peer is up too."""
        listening = self.source.is_ready()
        up, n = self.source.peers_up()
        all_up = up == n
        ok = listening and (all_up or request.query.get("peers") != "all")
        body = {"ready": ok, "listening": listening, "peers_up": up, "peers": n, "all_peers_up": all_up}
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.source.metrics_text())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.source.describe() | self.identity())

    def identity(self) -> dict:
        """Which process answered: what ``pdd-wire status`` prints so that an operator knows
        whose agent it reached."""
        return {"pid": os.getpid(), "uid": os.getuid(), "version": __version__,
                "config": getattr(self.source, "config_path", None), "admin": self.address}

    async def probe(self, request: web.Request) -> web.Response:
        """``POST /v1/probe {"peer": "B", "seconds": 4, "streams": null}``: RTT, jitter, loss and
        goodput over 1 and N bulk connections, measured through this agent's WAN path.

        The body must be sent as ``Content-Type: application/json`` (415 otherwise): a web page
        can make a browser POST cross-site only as a form or text/plain, so this keeps any page
        an operator opens from starting WAN probes through an agent on loopback."""
        if request.content_type != "application/json":
            raise web.HTTPUnsupportedMediaType(
                text=f"POST /v1/probe needs Content-Type: application/json, not {request.content_type!r}")
        req = await _probe_request(request)
        try:
            res = await self.source.probe(req.peer, req.seconds, req.streams)
        except PddWireError as exc:  # the request's own values (400), else the agent's state (409)
            status = 400 if exc.code == ErrorCode.BAD_REQUEST else 409
            return web.json_response({"error": str(exc), "code": exc.code.name}, status=status)
        except RuntimeError as exc:  # the measurement itself failed (link down mid-probe, ...)
            return web.json_response({"error": str(exc), "code": "PROBE_FAILED"}, status=409)
        return web.json_response(res)


class ProbeRequest(msgspec.Struct, forbid_unknown_fields=True):
    peer: str
    seconds: float = 4.0
    streams: int | None = None


async def _probe_request(request: web.Request) -> ProbeRequest:
    try:
        return msgspec.json.decode(await request.read(), type=ProbeRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise web.HTTPBadRequest(text=f"bad probe request: {exc}") from exc
