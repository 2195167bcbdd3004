"""An engine-socket connection driven by hand, as an engine written from proto/engine.md alone
would: raw bytes, fds as SCM_RIGHTS, every message the agent sends decoded."""

from __future__ import annotations

import array
import asyncio
import socket

from pdd_wire.engine import protocol as p


class RawEngine:
    """A hand-driven engine-socket connection: raw bytes, fds as SCM_RIGHTS, raw replies."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.dec = p.Decoder(to_agent=False)
        self.inbox: list[p.Msg] = []
        self.eof = False

    async def connect(self) -> "RawEngine":
        await asyncio.get_running_loop().sock_connect(self.sock, self.path)
        return self

    async def send(self, data: bytes, fd: int | None = None) -> None:
        if fd is None:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        else:
            n = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            assert n == len(data)

    async def _read(self) -> None:
        try:
            data = await asyncio.get_running_loop().sock_recv(self.sock, 1 << 16)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return
        self.inbox += self.dec.feed(data)

    async def reply(self, timeout: float = 10) -> p.Msg:
        async with asyncio.timeout(timeout):
            while not self.inbox:
                assert not self.eof, "the agent closed the engine socket"
                await self._read()
        return self.inbox.pop(0)

    async def until_closed(self, timeout: float = 10) -> list[p.Msg]:
        """Every message the agent sent, up to its end of the connection (end-of-file or reset)."""
        async with asyncio.timeout(timeout):
            while not self.eof:
                await self._read()
        out, self.inbox = self.inbox, []
        return out

    def nothing_yet(self) -> bool:
        """Nothing from the agent waits unread (no reply, no end of file) right now."""
        try:
            return not self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True

    def close(self) -> None:
        self.sock.close()
