"""A peer written from proto/ alone: raw frames on a real socket, nothing of the agent's session
code. The hostile-peer and outcome tests drive a real agent with it."""

from __future__ import annotations

import asyncio

from pdd_wire.transport.tcp import KIND_CONTROL, preamble
from pdd_wire.wire import FrameReader, FrameType, decode_body, encode_body, encode_bytes
from pdd_wire.wire import messages as m
from pdd_wire.wire.frame import LANE_OF


class RawPeer:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = FrameReader(max_body=1 << 20)
        self.pending: list = []

    @classmethod
    async def dial(cls, port: int, kind: int) -> "RawPeer":
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(preamble(kind))
        return cls(r, w)

    def send(self, ftype: int, body, **kw) -> None:
        """One frame; ``body`` a message (encoded here) or raw bytes; on its proper lane unless
        ``lane`` says otherwise."""
        kw.setdefault("lane", LANE_OF[int(ftype)])
        self.writer.write(encode_bytes(ftype, encode_body(body) if not isinstance(body, bytes) else body, **kw))

    async def next(self, timeout: float = 10):
        """The next frame's (type, decoded body); None once the agent closed the connection."""
        async with asyncio.timeout(timeout):
            while not self.pending:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:  # aborted: what was unread may be lost with it
                    return None
                if not data:
                    return None
                self.pending += self.frames.feed(data)
        f = self.pending.pop(0)
        return f.header.type, decode_body(f.header.type, f.body), f.header

    async def until(self, ftype: int, timeout: float = 10):
        """Frames up to and including the first of ``ftype`` (None at the end if the connection closed)."""
        return await self.until_any((ftype,), timeout)

    async def until_any(self, types, timeout: float = 10):
        """Frames up to and including the first of any of ``types`` (None at the end if closed)."""
        seen = []
        while (f := await self.next(timeout)) is not None:
            seen.append(f)
            if f[0] in types:
                break
        else:
            seen.append(None)
        return seen

    async def until_closed(self) -> list:
        out = []
        while (f := await self.next()) is not None:
            out.append(f[:2])
        return out

    async def pong(self, nonce: int) -> bool:
        """PING and wait for its PONG: every frame sent before was handled. False if closed."""
        self.send(FrameType.PING, m.Ping(nonce=nonce, sent_ns=1))
        while (f := await self.next()) is not None:
            if f[0] == FrameType.PONG and f[1].nonce == nonce:
                return True
        return False

    async def keepalive(self, every_s: float = 0.3) -> None:
        """PING (nonce 0) forever, so the agent never finds this peer silent (run it as a task)."""
        while not self.writer.is_closing():
            self.send(FrameType.PING, m.Ping(nonce=0, sent_ns=1))
            await asyncio.sleep(every_s)

    def close(self) -> None:
        self.writer.close()


async def hello(port: int, site: str = "A", node: str = "a1", incarnation: int = 77,
                capabilities: tuple[str, ...] = ("kv.v1", "tokens.v1", "abort.v1")) -> tuple[RawPeer, m.Welcome]:
    peer = await RawPeer.dial(port, KIND_CONTROL)
    peer.send(FrameType.HELLO, m.Hello(versions=[1], site=site, node=node, incarnation=incarnation,
                                       capabilities=list(capabilities)))
    t, welcome, _ = await peer.next()
    assert t == FrameType.WELCOME, (t, welcome)
    return peer, welcome
