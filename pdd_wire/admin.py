"""The admin HTTP server (aiohttp): /healthz, /readyz, /metrics, /v1/status."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .config import parse_hostport
from .errors import PddWireError

if TYPE_CHECKING:
    from .agent import Agent


class AdminServer:
    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
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
        host, port = parse_hostport(self.agent.config.listen.admin, "listen.admin")
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sock = site._server.sockets[0]
        h, p = sock.getsockname()[:2]
        self.address = f"{h}:{p}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: the event loop answers."""
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: listeners bound and not stopping. Peers being down does not make us unready
        (the engine still gets clear errors); their state is in /v1/status."""
        a = self.agent
        ok = a.ready.is_set() and not a.stopping
        body = {"ready": ok, "peers_up": sum(s.is_up for s in a.sessions.values()), "peers": len(a.sessions)}
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.agent.metrics.render())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.agent.describe())

    async def probe(self, request: web.Request) -> web.Response:
        """``POST /v1/probe {"peer": "B", "seconds": 4, "streams": null}``: RTT, jitter, loss and
        goodput over 1 and N bulk connections, measured through this agent's WAN path."""
        req = await _probe_request(request)
        try:
            res = await self.agent.probe(req.peer, req.seconds, req.streams)
        except PddWireError as exc:
            return web.json_response({"error": str(exc), "code": exc.code.name}, status=409)
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
