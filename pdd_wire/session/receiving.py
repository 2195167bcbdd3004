"""The receiving side of a peer session: KV transfers from the peer, KV_BEGIN to KV_DONE.

What to answer about a chunk, a repeated KV_BEGIN or a KV_RESUME is decided by the sans-IO
:class:`~.protocol.ReceiveLedger`; this module carries it out. Memory goes back to the engine
only once no data path can write into it (:meth:`Receiver.fail` closes the route and waits).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from ..errors import ErrorCode
from ..memory import BlockMap
from ..transfer import InTransfer, State
from ..transport.route import Route
from ..wire import FrameType
from ..wire import messages as m
from ..wire.handshake import MAX_CHUNK
from .protocol import Landing, ReceiveLedger, Status, code_name

if TYPE_CHECKING:
    from .host import Shell

#: The receiver's own clock ends a transfer this long after the sender's deadline, so that
#: both sides end even if the sender's KV_CANCEL is lost.
DEADLINE_SLACK_S = 1.0
#: How long a stalled data path may keep writing into a closing transfer before its lanes are cut.
QUIESCE_S = 1.0


class Receiver:
    def __init__(self, session: "Shell") -> None:
        self.s = session
        self.inn: dict[int, InTransfer] = {}
        self.routes: dict[int, Route] = {}  # read by data-path threads; mutated only here
        self.ledger = ReceiveLedger(keep=4 * session.cfg.transfer.max_transfers)

    def on_begin(self, tid: int, begin: m.KvBegin) -> None:
        s = self.s
        t = self.inn.get(tid)
        if t is not None:
            if t.state == State.MOVING:  # our KV_ACCEPT was lost with a connection
                s.send_frame(FrameType.KV_ACCEPT, m.KvAccept(begin.request_id), tid=tid)
            return
        if tid in self.ledger.completed:
            s.send_frame(FrameType.KV_DONE, m.KvDone(begin.request_id, begin.total_bytes), tid=tid)
            return
        s.host.incoming_begin(s, tid, begin)

    def accept(self, tid: int, begin: m.KvBegin, engine, dest: BlockMap) -> InTransfer | None:
        s = self.s
        problem = None
        if dest.total != begin.total_bytes or dest.block_bytes != begin.block_bytes:
            problem = (ErrorCode.SIZE_MISMATCH,
                       f"sender has {begin.n_blocks} blocks of {begin.block_bytes} bytes, receiver posted "
                       f"{dest.n_blocks} blocks of {dest.block_bytes} bytes")
        elif begin.chunk_bytes <= 0 or begin.chunk_bytes > MAX_CHUNK or \
                begin.n_chunks != -(-begin.total_bytes // begin.chunk_bytes):
            problem = (ErrorCode.MALFORMED_BODY, "inconsistent chunking in KV_BEGIN")
        elif len(self.inn) >= s.cfg.transfer.max_transfers:
            problem = (ErrorCode.TOO_MANY_TRANSFERS, "receiver has too many open transfers")
        loop = asyncio.get_running_loop()
        budget = begin.deadline_ms / 1000 if begin.deadline_ms else s.cfg.transfer.default_deadline_s
        t = InTransfer(tid, begin.request_id, engine, s.key, dest, begin.chunk_bytes, loop.time() + budget, loop=loop)
        if problem is not None:
            self.reject(tid, begin, *problem)
            t.state = State.FAILED
            s.host.transfer_failed(t, "in", int(problem[0]), problem[1])
            return None
        t.state = State.MOVING
        self.inn[tid] = t
        self.routes[tid] = t.route
        t.timer = loop.call_at(t.deadline + DEADLINE_SLACK_S, self.fail_later, t, ErrorCode.TRANSFER_TIMEOUT,
                               "transfer deadline passed", True)
        s.metrics.inflight.labels(direction="in").inc()
        s.data.expect(tid, t.route)
        s.send_frame(FrameType.KV_ACCEPT, m.KvAccept(begin.request_id), tid=tid)
        return t

    def reject(self, tid: int, begin: m.KvBegin, code: int, message: str) -> None:
        s = self.s
        s.count_error(code)
        s.log.warning("refused incoming KV", transfer_id=tid, request_id=begin.request_id,
                      code=code_name(code), reason=message)
        s.send_frame(FrameType.KV_REJECT, m.KvReject(begin.request_id, int(code), message), tid=tid)

    def chunk_arrived(self, tid: int, k: int, ok: bool, nbytes: int, claimed: bool, invalid: bool = False) -> None:
        s = self.s
        t = self.inn.get(tid)
        verdict = self.ledger.landing(
            tid, is_open=t is not None, verified=t is not None and k in t.route.verified, claimed=claimed,
            ok=ok, invalid=invalid,
            complete=t is not None and t.state == State.MOVING and t.route.complete)
        match verdict:
            case Landing.DROP:
                return
            case Landing.ACK_AGAIN:
                s.metrics.duplicates.labels(peer=s.key).inc()
                s.send_frame(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
                return
            case Landing.NACK_BUSY:
                # Another connection still holds this chunk (one that died mid-chunk and has
                # not noticed yet): ask for it again a little later.
                s.send_frame(FrameType.KV_NACK, m.KvNack(k, int(ErrorCode.CHUNK_BUSY)), tid=tid)
                return
        assert t is not None  # every other verdict is about an open transfer
        match verdict:
            case Landing.FAIL_INVALID:
                self.fail_later(t, ErrorCode.MALFORMED_BODY,
                                f"chunk {k} of {nbytes} bytes does not fit the announced transfer", True)
            case Landing.NACK_CHECKSUM:
                s.metrics.checksum_failures.labels(peer=s.key).inc()
                s.count_error(ErrorCode.CHUNK_CHECKSUM)
                s.log.warning("chunk payload checksum failed; asking for it again", transfer_id=tid,
                              request_id=t.request_id, chunk=k)
                s.send_frame(FrameType.KV_NACK, m.KvNack(k), tid=tid)
            case Landing.ACK | Landing.ACK_COMPLETE:
                s.metrics.bytes.labels(peer=s.key, lane="bulk", direction="rx").inc(nbytes)
                s.metrics.chunks.labels(peer=s.key, direction="rx").inc()
                s.send_frame(FrameType.KV_ACK, m.KvAck(k, 1), tid=tid)
                if verdict is Landing.ACK_COMPLETE:
                    t.state = State.DONE
                    s.spawn(self._complete(t), f"complete{tid}")

    async def _complete(self, t: InTransfer) -> None:
        s = self.s
        await t.route.close()
        self._forget(t)
        self.ledger.completed_transfer(t.tid, t.request_id)
        s.send_frame(FrameType.KV_DONE, m.KvDone(t.request_id, t.total), tid=t.tid)
        s.metrics.transfers.labels(peer=s.key, direction="in", outcome="done").inc()
        s.metrics.transfer_seconds.labels(direction="in").observe(time.monotonic() - t.started)
        s.host.kv_received(t)

    async def _quiesce(self, route: Route) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(route.close()), QUIESCE_S)
        except TimeoutError:
            # A data path is stalled in the middle of one of this transfer's chunks: cut its
            # lanes so the claim is released.
            self.s.log.warning("bulk connection stalled mid-chunk; resetting bulk connections")
            self.s.data.stall()
            await route.quiesced

    def _forget(self, t: InTransfer) -> None:
        if self.inn.pop(t.tid, None) is not None:
            self.s.metrics.inflight.labels(direction="in").dec()
            self.s.host.transfer_ended()
        self.routes.pop(t.tid, None)
        if t.timer is not None:
            t.timer.cancel()

    def fail_later(self, t: InTransfer, code: int, message: str, notify_peer: bool) -> None:
        """Schedule :meth:`fail` (it waits for the data path to let go of the memory)."""
        self.s.spawn(self.fail(t, code, message, notify_peer=notify_peer), f"fail{t.tid}")

    async def fail(self, t: InTransfer, code: int, message: str, *, notify_peer: bool) -> None:
        if self.inn.get(t.tid) is not t or t.state in (State.FAILED, State.DONE):
            return
        s = self.s
        t.state = State.FAILED
        self.routes.pop(t.tid, None)
        await s.data.forget(t.tid)
        await self._quiesce(t.route)  # no data path writes into the blocks after this
        self._forget(t)
        if notify_peer:
            s.cancel_transfer(t.tid, m.KvCancel(t.request_id, int(code), message, True))
        s.count_failure("in", code)
        s.host.transfer_failed(t, "in", int(code), message)

    async def fail_all(self, code: int, message: str, *, notify_peer: bool, engine=None) -> int:
        ts = [t for t in self.inn.values() if engine in (None, t.engine)]
        for t in ts:
            await self.fail(t, code, message, notify_peer=notify_peer)
        return len(ts)

    def on_cancel(self, tid: int, msg: m.KvCancel) -> None:
        t = self.inn.get(tid)
        if t is not None:
            self.fail_later(t, msg.code, f"cancelled by peer {self.s.key}: {msg.message}", False)
        self.s.host.incoming_cancelled(self.s, tid, msg)

    def on_resume(self, tid: int, msg: m.KvResume) -> None:
        t = self.inn.get(tid)
        verified = t.route.snapshot() if t is not None else None
        state = self.ledger.status(tid, verified)
        have = m.bitmap_from(verified, t.route.n_chunks) if t is not None and verified is not None else b""
        if state == Status.RECEIVING:
            self.s.send_frame(FrameType.KV_STATUS, m.KvStatus(msg.request_id, int(state), have), tid=tid)
        else:
            self.s.send_frame(FrameType.KV_STATUS, m.KvStatus(msg.request_id, int(state)), tid=tid)

    def peer_restarted(self) -> None:
        for t in list(self.inn.values()):
            self.fail_later(t, ErrorCode.PEER_RESTARTED, f"peer {self.s.key} restarted", False)
        self.ledger.clear()
