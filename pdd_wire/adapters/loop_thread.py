"""A private asyncio event loop on a daemon thread, for synchronous engine code.

Engines such as vLLM call their connector from plain (non-async) methods; the
:class:`~pdd_wire.EngineClient` is asyncio. A :class:`LoopThread` owns one loop on its own
thread, and :meth:`LoopThread.run` submits a coroutine to it and blocks for the result, so the
engine's thread never runs (or blocks) the loop that reads the agent's socket.

Example::

    lt = LoopThread("pdd-wire-vllm")
    eng = lt.run(EngineClient(path, "vllm-worker").connect())
    region = lt.run(eng.register(fd, block_bytes=16384, size=size))
    lt.close(eng.close())
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "pdd-wire-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def close(self, final: Coroutine[Any, Any, Any] | None = None, timeout: float = 5) -> None:
        """Run ``final`` (e.g. a client's ``close()``), then stop the loop and join the thread."""
        if not self._thread.is_alive():
            if final is not None:
                final.close()
            return
        if final is not None:
            try:
                self.run(final, timeout)
            except Exception:  # closing: nothing left to tell
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
