"""What every simulated engine serving many requests shares: one task reading the engine's
events (:class:`EventLoopEngine`)."""

from __future__ import annotations

import asyncio

from pdd_wire.engine import protocol as p
from pdd_wire.engine.client import EngineClient
from pdd_wire.errors import EngineRequestError


class EventLoopEngine:
    """One task takes every event of the engine connection and hands it to :meth:`on_event`
    (O(1) per event, whatever the number of requests in flight)."""

    eng: EngineClient

    def start_events(self) -> None:
        # Public: it ends when the engine connection does (the demo watches it).
        self.events_task = asyncio.create_task(self._event_loop(), name=f"{type(self).__name__}-events")
        self.errors: list[str] = []

    async def _event_loop(self) -> None:
        while True:
            ev = await self.eng.next_event()
            try:
                await self.on_event(ev)
            except (EngineRequestError, AssertionError) as exc:
                self.errors.append(f"{type(ev).__name__} {getattr(ev, 'request_id', '')}: {exc}")

    async def on_event(self, ev: p.Msg) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def stop_tasks(self, *tasks: asyncio.Task | None) -> None:
        live = [t for t in (*tasks, getattr(self, "events_task", None)) if t is not None]
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)
