"""The agent's end of the engine socket: accepts engines, reads requests (and the fds that
ride with them), writes replies and events.

Reads use ``recvmsg`` on the raw non-blocking socket (asyncio transports cannot receive
SCM_RIGHTS). Writes go through a bounded buffer: an engine that stops reading its events is
disconnected rather than allowed to grow the agent's memory, and its transfers are cancelled.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import errno
import functools
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from .engine import protocol as p
from .errors import ConfigError, EngineRequestError, ErrorCode, PddWireError
from .rundir import secure_dir, socket_dir_key

if TYPE_CHECKING:
    from .memory import Region

log = structlog.get_logger("pdd_wire.engine")

MAX_FDS = 4  # fds in one recvmsg, and fds held that no register request read so far claims
MAX_PENDING_REGISTERS = 16  # registers read and waiting their turn (each holds its fd); more stay in the socket


MAX_QUEUED = 1024  # requests of one engine decoded and waiting; more stay in the socket
NOW_PER_READ = 32  # requests answered within one read (EngineServer.now_types); the rest are queued
#: An engine's requests hold the loop at most this long at a time (those answered in a read, and
#: the worker's between yields): a write of requests that never wait, or of costly ones (status
#: with thousands of transfers open: 17 ms each), no longer runs as one step of the loop (5 s).
SERVE_BUDGET_S = 0.001
_END = object()  # queued after the last request read before a protocol error: the worker then sends the err
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13: the peer's supplementary groups
NGROUPS_MAX = 65536  # Linux's limit on a process's supplementary groups


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The supplementary groups of the process at the other end (``SO_PEERGROUPS``, as they were
    when it connected). Python's ``getsockopt`` takes at most 1024 bytes, so libc's is called with
    a buffer grown on ``ERANGE`` (the kernel then says how much it needs). () where the kernel
    has no ``SO_PEERGROUPS``."""
    n = 64
    while True:
        buf = (ctypes.c_uint32 * n)()
        size = ctypes.c_uint32(ctypes.sizeof(buf))
        if _libc().getsockopt(sock.fileno(), socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) == 0:
            return tuple(buf[: size.value // 4])
        err = ctypes.get_errno()
        if err == errno.ERANGE and n < NGROUPS_MAX:
            n = min(NGROUPS_MAX, max(2 * n, size.value // 4))
            continue
        if err in (errno.ENOPROTOOPT, errno.EINVAL):
            return ()
        raise OSError(err, os.strerror(err))


#: Relayed tokens are given to an engine only while it has less than this share of
#: ``limits.engine_queue_bytes`` unread (:attr:`EngineConn.full_for_tokens`).
TOKENS_QUEUE_SHARE = 4


class EngineConn:
    """One connected engine."""

    def __init__(self, server: "EngineServer", sock: socket.socket, number: int, uid: int, pid: int) -> None:
        self.server = server
        self.sock = sock
        self.number = number
        self.uid = uid
        self.pid = pid
        self.name = f"engine-{number}"
        self.log = log.bind(engine=self.name, pid=pid)
        self.loop = asyncio.get_running_loop()
        self._decoder = p.Decoder(to_agent=True, max_message=server.max_message)
        self._fds: list[int] = []
        self._claims = 0  # register requests read whose turn (and fd) has not come yet
        self._out = bytearray()
        self._writing = False
        self._full_timer: asyncio.TimerHandle | None = None  # full_for_tokens, and reading nothing: cut off
        self._took_at = self.loop.time()  # when the engine last took bytes from its socket (or connected)
        self.closed = False
        self.closed_at = 0.0
        self.done = self.loop.create_future()
        self.regions: dict[int, Region] = {}
        self.load = 0.0  # the engine's decode load, as it last reported (set_load)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._reading = True  # paused while MAX_QUEUED requests wait: the kernel buffer holds the rest
        self._busy = False  # the worker holds a request (answering one now would overtake it)
        # A protocol error and why: the err goes out once the requests read before it are answered.
        self._ending: tuple[p.Err, str] | None = None
        self._worker = asyncio.create_task(self._serve(), name=f"{self.name}:serve")
        self.loop.add_reader(sock.fileno(), self._readable)
        # The first message, and then every message begun, must be complete within the read
        # deadline: a length prefix followed by silence, or a connection that never speaks,
        # does not hold a slot (and up to 16 MiB of buffer) forever.
        self._deadline: asyncio.TimerHandle | None = self.loop.call_later(server.read_deadline_s, self._too_slow)

    def _readable(self) -> None:
        try:
            data, anc, flags, _ = self.sock.recvmsg(256 * 1024, socket.CMSG_SPACE(MAX_FDS * 4))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(f"read failed: {exc}")
            return
        held = len(self._fds)
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            self._refuse(f"more than {MAX_FDS} file descriptors in one message", held)
            return
        if not data:
            self.close("engine closed the socket")
            return
        bad: p.BadMessage | None = None
        try:
            msgs = self._decoder.feed(data)
        except p.BadMessage as exc:
            # The requests read in full before the offending bytes are still served, in order
            # (proto/engine.md §2: each gets its reply); the connection ends after them.
            msgs, bad = exc.decoded, exc
        claims = sum(1 for msg in msgs if type(msg) is p.Register)
        # An fd rides with the first byte of its register (proto/engine.md §4), so by now every
        # register read has its fd here; what no register claims is limited. Each register
        # takes the oldest fd at its turn: a register sent without its fd (a broken engine)
        # takes the next one's, which the spec warns of.
        unclaimed = len(self._fds) - self._claims - claims
        if unclaimed > MAX_FDS:
            self._refuse(f"{unclaimed} file descriptors sent without register requests to use them", held)
            return
        self._claims += claims
        now, budget, until = self.server.now_types, NOW_PER_READ, time.monotonic() + SERVE_BUDGET_S
        for msg in msgs:
            # A request that never waits is answered here, in the read, when nothing is ahead
            # of it: no task wake-up per request (on the path of every transfer). At most
            # NOW_PER_READ of them, and none past SERVE_BUDGET_S: a read full of requests does
            # not hold the loop (the rest go to the worker, which yields as it goes).
            if budget and not self._busy and not self._queue.qsize() and type(msg) in now:
                budget -= 1
                self._answer_now(msg)
                if self.closed:  # its answer overflowed the engine's queue: it is cut off
                    return
                if time.monotonic() >= until:
                    budget = 0
            else:
                self._queue.put_nowait(msg)
        if bad is not None:
            self.server.on_error(bad.code)
            self._end(p.Err(code=int(bad.code), message=str(bad)), f"protocol error: {bad}")
            return
        if (self._queue.qsize() >= MAX_QUEUED or self._claims >= MAX_PENDING_REGISTERS) and self._reading:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False
        self._rearm(restart=bool(msgs))

    async def _serve(self) -> None:
        """Requests are handled one at a time, in order, so an engine sees its own effects in order.
        Most never wait, so a queue of them would run as one step of the loop: the worker yields
        once those it ran took SERVE_BUDGET_S, and stops at once when the engine is cut off."""
        turn = time.monotonic()
        while True:
            if self._queue.empty():
                msg = await self._queue.get()
                turn = time.monotonic()
            else:
                msg = self._queue.get_nowait()
            if msg is _END:
                self._finish()
                return
            if self.closed:
                return  # cut off: nobody reads the answers (and its memory is being released)
            self._busy = True
            try:
                await self._answer(msg)
            finally:
                self._busy = False
            if time.monotonic() - turn >= SERVE_BUDGET_S:
                await asyncio.sleep(0)
                turn = time.monotonic()

    @property
    def pending_registers(self) -> int:
        """Register requests read and waiting for their turn (the read-ahead MAX_PENDING_REGISTERS bounds)."""
        return self._claims

    def _refuse(self, why: str, held: int) -> None:
        """A file descriptor rule broken: tell the engine (``err {id 0, BAD_REQUEST}``), then close.
        Which message of the read the fds came with cannot be told, so none of that read's
        messages is served and its fds are closed now; the requests read before it are served
        first, as for any protocol error."""
        for fd in self._fds[held:]:
            os.close(fd)
        del self._fds[held:]
        self.server.on_error(ErrorCode.BAD_REQUEST)
        self._end(p.Err(code=int(ErrorCode.BAD_REQUEST), message=why), why)

    def _end(self, err: p.Err, why: str) -> None:
        """The engine broke the protocol: read nothing more, serve the requests read in full
        before it (each still gets its reply, in order: proto/engine.md §2), then send ``err``
        (id 0) and close."""
        if self.closed or self._ending is not None:
            return
        self._ending = (err, why)
        self._stop_reading()
        if self._busy or self._queue.qsize():
            self._queue.put_nowait(_END)  # the worker sends it when it gets there
        else:
            self._finish()

    def _finish(self) -> None:
        assert self._ending is not None
        err, why = self._ending
        self.send(err)
        self.close(why)

    def _stop_reading(self) -> None:
        """Nothing after the offending bytes is read (nor served), and no read deadline runs."""
        if self._reading:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    async def _answer(self, msg: p.Msg) -> None:
        if isinstance(msg, p.Register):
            self._claims -= 1
        if (not self._reading and self._queue.qsize() < MAX_QUEUED // 2
                and self._claims < MAX_PENDING_REGISTERS // 2 and not self.closed and self._ending is None):
            self.loop.add_reader(self.sock.fileno(), self._readable)
            self._reading = True
            self._rearm(restart=True)
        fd = None
        if isinstance(msg, p.Register):
            if not self._fds:
                self.send(p.Err(id=msg.id, code=int(ErrorCode.BAD_REQUEST),
                                message="register needs one file descriptor sent with its first byte (SCM_RIGHTS)"))
                return
            fd = self._fds.pop(0)
        try:
            result = await self.server.handler(self, msg, fd)
        except Exception as exc:
            self._failed(msg, exc)
        else:
            self.send(p.Ok(id=msg.id, result=result or {}))

    def _answer_now(self, msg: p.Msg) -> None:
        assert self.server.now_handler is not None  # now_types is empty without one
        try:
            result = self.server.now_handler(self, msg)
        except Exception as exc:
            self._failed(msg, exc)
        else:
            self.send(p.Ok(id=msg.id, result=result or {}))

    def _failed(self, msg: p.Msg, exc: Exception) -> None:
        if isinstance(exc, (EngineRequestError, PddWireError)):
            self.server.on_error(exc.code)
            self.send(p.Err(id=msg.id, code=int(exc.code), message=str(exc)))
        else:  # a bug must not take the agent down with it
            self.log.error("engine request failed", op=type(msg).__name__, exc_info=exc)
            self.send(p.Err(id=msg.id, code=int(ErrorCode.INTERNAL), message=f"internal error: {exc}"))

    def _rearm(self, *, restart: bool) -> None:
        """A deadline runs while a message is begun (and the agent is reading): from its first
        byte, or from the last message completed when messages follow each other in one stream."""
        if self._deadline is not None and (restart or not self._decoder.pending or not self._reading):
            self._deadline.cancel()
            self._deadline = None
        if self._deadline is None and self._decoder.pending and self._reading and not self.closed:
            self._deadline = self.loop.call_later(self.server.read_deadline_s, self._too_slow)

    def _too_slow(self) -> None:
        self._deadline = None
        what = (f"{self._decoder.pending} bytes of a message" if self._decoder.pending else "no message")
        self.server.on_error(ErrorCode.BAD_REQUEST)
        self._end(p.Err(code=int(ErrorCode.BAD_REQUEST),
                        message=f"{what} after {self.server.read_deadline_s} s: closing (timeouts.engine_read_s)"),
                  f"read deadline: {what} within {self.server.read_deadline_s} s")

    @property
    def full_for_tokens(self) -> bool:
        """A quarter of ``limits.engine_queue_bytes`` unread: relayed tokens wait for it to read
        (unacknowledged, asked for again: proto/transfer.md §12) rather than fill the rest, so a
        peer's burst of tokens slows that peer and does not by itself cut the engine off (one that
        takes nothing for the read deadline meanwhile is: :meth:`_still_full`)."""
        return len(self._out) * TOKENS_QUEUE_SHARE >= self.server.max_out

    def send(self, msg: p.Msg) -> None:
        if self.closed:
            return
        self._out += p.encode(msg)
        if len(self._out) > self.server.max_out:
            self.close(f"engine is not reading its events ({len(self._out)} bytes queued)")
            return
        if self._full_timer is None and self.full_for_tokens:
            # Relayed tokens wait for it now, and hold their sender's per-peer budget meanwhile:
            # an engine that stays this full for the read deadline is stuck, and is cut off.
            self._full_timer = self.loop.call_later(self.server.read_deadline_s, self._still_full)
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                n = self.sock.send(self._out)
                del self._out[:n]
                if n:
                    self._took_at = self.loop.time()
                if self._full_timer is not None and not self.full_for_tokens:
                    self._full_timer.cancel()
                    self._full_timer = None
        except (BlockingIOError, InterruptedError):
            if not self._writing:
                self._writing = True
                self.loop.add_writer(self.sock.fileno(), self._on_writable)
            return
        except OSError as exc:
            self.close(f"write failed: {exc}")
            return
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.sock.fileno())

    def _on_writable(self) -> None:
        self._flush()

    def _still_full(self) -> None:
        """A quarter of its queue unread: cut off once it has taken nothing for the read deadline
        (it is not reading), else watched until then."""
        self._full_timer = None
        if not self.full_for_tokens:
            return
        due = self._took_at + self.server.read_deadline_s
        if self.loop.time() >= due:
            self.close(f"engine is not reading its events ({len(self._out)} bytes queued, none taken in "
                       f"{self.server.read_deadline_s} s)")
        else:
            self._full_timer = self.loop.call_at(due, self._still_full)

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.closed_at = time.monotonic()
        self.log.info("engine disconnected", reason=why)
        for timer in (self._deadline, self._full_timer):
            if timer is not None:
                timer.cancel()
        self._deadline = self._full_timer = None
        try:
            self.loop.remove_reader(self.sock.fileno())
            if self._writing:
                self.loop.remove_writer(self.sock.fileno())
        except Exception:
            pass
        self._worker.cancel()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        # The socket stays open until its transfers are cancelled and its memory released
        # (EngineServer._run_gone): an engine that sees its connection end may reuse its blocks
        # at once, so by then nothing of the agent's may still write into them.
        self.server.gone(self)


class EngineServer:
    """Listens on the engine Unix socket. ``handler(conn, msg, fd)`` serves each request;
    ``on_gone(conn)`` runs once per engine when it disconnects. Requests of ``now_types`` may
    instead be answered by ``now_handler(conn, msg)`` (synchronous) as soon as they are read,
    when none of the engine's requests is ahead of them: the same answer, without a task step."""

    def __init__(self, path: str, mode: int, *, handler: Callable[..., Awaitable[dict | None]],
                 on_gone: Callable[[EngineConn], Awaitable[None]], max_engines: int, max_message: int,
                 allowed_uids: set[int], allowed_gids: set[int] | frozenset[int] = frozenset(),
                 socket_gid: int | None = None,
                 on_error=lambda code: None,
                 max_out: int = 64 << 20, max_per_uid: int | None = None, read_deadline_s: float = 5.0,
                 now_handler: Callable[..., dict | None] | None = None,
                 now_types: frozenset[type] = frozenset()) -> None:
        self.path = path
        self.mode = mode
        self.handler = handler
        self.now_handler = now_handler
        self.now_types = now_types if now_handler is not None else frozenset()
        assert p.Register not in self.now_types  # a register waits for its turn (and holds its fd until then)
        self.on_gone = on_gone
        self.on_error = on_error
        self.max_engines = max_engines
        # Slots per uid: one uid's (idle) connections cannot take every slot from the others.
        self.max_per_uid = max_engines if max_per_uid is None else max_per_uid
        self.read_deadline_s = read_deadline_s
        self.max_message = max_message
        self.max_out = max_out  # bytes of unread events before an engine is cut off
        self.allowed_uids = allowed_uids
        self.allowed_gids = allowed_gids
        self.socket_gid = socket_gid  # the socket's group (listen.engine_gid): 0o660 then admits it
        self.engines: dict[int, EngineConn] = {}
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._count = 0
        self._gone_tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        # Whoever can write the socket's directory can rename the socket and bind their own, and
        # be handed the engines' memfds: refuse a directory another user owns or can write.
        secure_dir(os.path.dirname(os.path.abspath(self.path)), socket_dir_key(self.path))
        if os.path.exists(self.path):
            # A stale socket from a previous run; refuse to steal one a live agent is using.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)
            else:
                raise PddWireError(f"engine socket {self.path} is in use by another agent", ErrorCode.INTERNAL)
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound owner-only, given its group, then its mode: the agent's own group never gets in.
        old = os.umask(0o777 & ~(self.mode & 0o700))
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        if self.socket_gid is not None:
            try:  # root may; another uid only for a group it is a member of (chown(2))
                os.chown(self.path, -1, self.socket_gid)
            except OSError as exc:
                sock.close()
                os.unlink(self.path)
                raise ConfigError("listen.engine_gid", f"cannot give the engine socket {self.path} the group "
                                  f"{self.socket_gid}: {exc.strerror} (an agent not run as root must be a member "
                                  f"of that group: SupplementaryGroups= in its unit, or usermod -aG)") from None
        os.chmod(self.path, self.mode)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._accept_task = asyncio.create_task(self._accept_forever(sock), name="engine-accept")

    async def _accept_forever(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(sock)
            conn.setblocking(False)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
            pid, uid, gid = struct.unpack("iII", creds)  # struct ucred: pid_t, uid_t, gid_t (unsigned)
            if not self._admits(conn, uid, gid):
                log.warning("engine refused: neither its uid nor any of its groups is allowed (listen.engine_uid, "
                            "listen.engine_gid)", uid=uid, gid=gid, pid=pid)
                self.on_error(ErrorCode.BAD_REQUEST)
                conn.close()
                continue
            mine = sum(1 for e in self.engines.values() if e.uid == uid)
            if len(self.engines) >= self.max_engines or mine >= self.max_per_uid:
                full = len(self.engines) >= self.max_engines
                log.warning("engine refused: limits.max_engines reached" if full else
                            "engine refused: limits.max_engines_per_uid reached", uid=uid,
                            limit=self.max_engines if full else self.max_per_uid)
                msg = p.encode(p.Err(code=int(ErrorCode.LIMIT_EXCEEDED),
                                     message=f"agent already serves {self.max_engines} engines (limits.max_engines)"
                                     if full else
                                     f"agent already serves {mine} engines of uid {uid} "
                                     f"(limits.max_engines_per_uid)"))
                try:
                    conn.send(msg)
                except OSError:
                    pass
                conn.close()
                continue
            self._count += 1
            ec = EngineConn(self, conn, self._count, uid, pid)
            self.engines[ec.number] = ec
            ec.log.info("engine connected", uid=uid)

    def _admits(self, conn: socket.socket, uid: int, gid: int) -> bool:
        """Its uid is allowed (or root), or its primary or a supplementary group is."""
        if uid in self.allowed_uids or uid == 0 or gid in self.allowed_gids:
            return True
        if not self.allowed_gids:
            return False
        try:
            return not self.allowed_gids.isdisjoint(peer_groups(conn))
        except OSError as exc:
            log.warning("cannot read an engine's groups (SO_PEERGROUPS)", uid=uid, error=exc.strerror)
            return False

    def gone(self, ec: EngineConn) -> None:
        self.engines.pop(ec.number, None)
        t = asyncio.get_running_loop().create_task(self._run_gone(ec))
        self._gone_tasks.add(t)
        t.add_done_callback(self._gone_tasks.discard)

    async def _run_gone(self, ec: EngineConn) -> None:
        try:
            await self.on_gone(ec)
        except Exception:
            ec.log.exception("releasing a gone engine's transfers and memory failed")
        finally:
            ec.sock.close()  # the engine's EOF: nothing of the agent's touches its memory any more
            if not ec.done.done():
                ec.done.set_result(None)

    async def stop_accepting(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
            self._accept_task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    async def close(self) -> None:
        await self.stop_accepting()
        for ec in list(self.engines.values()):
            ec.close("agent stopped")
        await asyncio.gather(*self._gone_tasks, return_exceptions=True)

    def broadcast(self, msg: p.Msg) -> None:
        for ec in list(self.engines.values()):
            ec.send(msg)
