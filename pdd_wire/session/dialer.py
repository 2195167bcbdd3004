"""The dialing side of a session's control connection: connect, HELLO, wait for WELCOME, hold
the connection until it is lost, dial again with backoff (the longest one after a refusal
that a retry cannot fix). The handshake in progress is one explicit :class:`Handshake`."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Timeouts
from ..errors import FatalHandshakeError, HandshakeError, TransportError
from ..log import limited
from ..transport.base import Connector
from ..transport.tcp import FrameProtocol
from ..wire import FrameType, encode, encode_body
from ..wire import messages as m
from ..wire.handshake import refusal

FIRST_BACKOFF_S = 0.05


@dataclass
class Handshake:
    """The dialer's handshake in progress: resolved by WELCOME, failed by ERROR or a loss."""

    conn: FrameProtocol
    done: asyncio.Future
    refusal_counted: bool = False  # the peer's ERROR frame was counted in the metrics already

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


class Dialer:
    def __init__(self, connector: Connector, timeouts: Timeouts, *, new_conn: Callable[[], FrameProtocol],
                 hello: Callable[[], m.Hello], count_error: Callable[[Any], None], log: Any) -> None:
        self.connector = connector
        self.timeouts = timeouts
        self.new_conn = new_conn
        self.hello = hello
        self.count_error = count_error
        self.log = log
        self.pending: Handshake | None = None
        self.lost = asyncio.Event()  # set when the established connection went
        self.closing = False

    async def run(self) -> None:
        backoff = FIRST_BACKOFF_S
        to = self.timeouts
        while not self.closing:
            self.lost.clear()
            hs: Handshake | None = None
            try:
                conn = self.new_conn()
                await self.connector.connect(conn, timeout=to.connect_s)
                hs = self.pending = Handshake(conn, asyncio.get_running_loop().create_future())
                conn.send(encode(FrameType.HELLO, encode_body(self.hello())))
                try:
                    async with asyncio.timeout(to.handshake_s):
                        await hs.done
                except BaseException:
                    conn.abort()
                    raise
                finally:
                    self.pending = None
                backoff = FIRST_BACKOFF_S
                await self.lost.wait()
            except FatalHandshakeError as exc:
                self.log.error("handshake refused", error=str(exc), code=exc.code.name)
                if hs is None or not hs.refusal_counted:
                    self.count_error(exc.code)
                backoff = to.reconnect_max_backoff_s
            except (TransportError, HandshakeError, TimeoutError, OSError) as exc:
                limited(self, self.log.info, "peer not reachable", error=str(exc) or type(exc).__name__)
            if self.closing:
                return
            await asyncio.sleep(backoff * (0.5 + random.random() / 2))
            backoff = min(backoff * 2, to.reconnect_max_backoff_s)

    def welcomed(self, msg: m.Welcome) -> None:
        if self.pending is not None and not self.pending.done.done():
            self.pending.done.set_result(msg)

    def failed(self, exc: BaseException) -> None:
        if self.pending is not None:
            self.pending.fail(exc)

    def refused(self, code: int, message: str) -> None:
        """The peer sent ERROR during the handshake (already counted in the metrics)."""
        if self.pending is not None and not self.pending.done.done():
            self.pending.refusal_counted = True
            self.pending.fail(refusal(code, message))

    def conn_lost(self, conn: FrameProtocol, exc: BaseException | None) -> None:
        if self.pending is not None and conn is self.pending.conn:
            self.pending.fail(TransportError(f"connection closed during the handshake: {exc}"))
