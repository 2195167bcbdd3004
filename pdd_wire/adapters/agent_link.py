"""An engine connection to the local agent that comes back after the agent restarts.

A synchronous engine (vLLM) polls its agent connection once per step, and while it is idle it
does not step at all; left to itself it would notice an agent restart only at the next request,
and could not register its memory again without stalling a step. :class:`AgentLink` watches the
connection on its :class:`~pdd_wire.adapters.loop_thread.LoopThread`: when it ends (the agent
stopped, restarted, or dropped it) :attr:`AgentLink.current` becomes None at once, and the link
reconnects with backoff, running ``setup`` (e.g. registering the engine's memory: a new agent
knows nothing of the last one's regions) before it hands the new connection out. The engine's
thread compares :attr:`AgentLink.current` with the connection it holds, at its own pace, and
fails what waited on one that ended."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..engine import protocol as p
from ..engine.client import EngineClient
from .loop_thread import LoopThread

log = logging.getLogger("vllm.pdd_wire")


class Conn:
    """One connection as handed out: ``generation`` counts the link's connections from 1;
    ``state`` is what ``setup`` returned for it."""

    __slots__ = ("generation", "eng", "state")

    def __init__(self, generation: int, eng: EngineClient, state: Any) -> None:
        self.generation, self.eng, self.state = generation, eng, state


class AgentLink:
    """The engine connection of ``engine`` to the agent at ``path``, kept up (module docstring)."""

    def __init__(self, lt: LoopThread, path: str, engine: str,
                 setup: Callable[[EngineClient], Awaitable[Any]] | None = None, *, end_on_shutdown: bool = False,
                 first_retry_s: float = 0.2, max_retry_s: float = 5.0) -> None:
        """``end_on_shutdown``: a ``shutdown`` event ends the connection at once (for a
        connection that holds nothing; one that does ends it itself, once it has ended its
        transfers: :meth:`drop`). Its other events stay with the engine."""
        self.lt, self.path, self.engine, self.setup = lt, path, engine, setup
        self.end_on_shutdown = end_on_shutdown
        self.first_retry_s, self.max_retry_s = first_retry_s, max_retry_s
        self.current: Conn | None = None  # set and cleared on the loop thread; read anywhere
        self.reason = ""  # why the last connection ended
        self.generation = 0
        self.lost = 0  # connections that ended
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self, timeout: float | None = 60) -> Conn:
        """Connect and set up now (raising: an engine does not start without its agent), then
        watch the connection."""
        conn = self.lt.run(self._open(), timeout)

        async def spawn() -> None:
            self._task = asyncio.get_running_loop().create_task(self._watch(conn))

        self.lt.run(spawn())
        return conn

    def drop(self, conn: Conn, reason: str) -> None:
        """End ``conn`` if it is still the current connection (e.g. its events were lost); the
        link reconnects. A newer connection is left alone."""
        async def drop() -> None:
            if self.current is conn:
                self.current, self.reason = None, reason
                await conn.eng.close()  # the watch sees it end

        self.lt.run(drop())

    def close(self) -> None:
        """Stop watching and close the connection (on the loop thread's own close)."""
        async def close() -> None:
            self._closing = True
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            conn, self.current = self.current, None
            if conn is not None:
                await conn.eng.close()

        with contextlib.suppress(Exception):
            self.lt.run(close(), 10)

    async def _open(self) -> Conn:
        eng = await EngineClient(self.path, self.engine).connect()
        try:
            state = await self.setup(eng) if self.setup is not None else None
        except BaseException:
            await eng.close()
            raise
        self.generation += 1
        conn = self.current = Conn(self.generation, eng, state)
        return conn

    async def _watch(self, conn: Conn) -> None:
        while not self._closing:
            try:
                if self.end_on_shutdown:
                    await conn.eng.wait_for(lambda ev: isinstance(ev, p.Shutdown))
                    reason = "the agent is shutting down"
                else:  # lost events do not end it: its owner decides (it may abort first)
                    ended = await conn.eng.wait_closed()
                    reason = str(ended) or type(ended).__name__
            except Exception as exc:  # the connection's end
                reason = str(exc) or type(exc).__name__
            if self.current is conn:
                self.current, self.reason = None, reason
            self.lost += 1
            with contextlib.suppress(Exception):
                await conn.eng.close()
            log.warning("pdd-wire: %s: the connection to the agent at %s ended (%s): reconnecting",
                        self.engine, self.path, self.reason)
            conn = await self._reconnect()

    async def _reconnect(self) -> Conn:
        """Until a new connection is set up: retries after 0.2 s, doubling up to 5 s."""
        delay, tries, t0 = self.first_retry_s, 0, time.monotonic()
        while True:
            await asyncio.sleep(delay)
            tries += 1
            try:
                conn = await self._open()
            except Exception as exc:
                if tries == 1:
                    log.warning("pdd-wire: %s: the agent at %s is not back yet (%s): retrying every %.1f s at "
                                "most", self.engine, self.path, exc, self.max_retry_s)
                delay = min(delay * 2, self.max_retry_s)
                continue
            log.info("pdd-wire: %s: connected to the agent at %s again after %.1f s (%d tries)",
                        self.engine, self.path, time.monotonic() - t0, tries)
            return conn
