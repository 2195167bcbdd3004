"""Link probes: transfers of scratch memory (never an engine's) through the real WAN path.

The scratch region is made on first use; its sender side is filled with random bytes once, so
that a link that compresses sees what KV looks like to it. Probe request ids start with
:data:`~pdd_wire.probe.PROBE_PREFIX`, which engines may not use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import EngineRequestError, ErrorCode
from ..memory import BlockMap, HostRegion, SharedMemory, as_extents
from ..probe import PROBE_PREFIX, PROBE_SCRATCH_BYTES, PROBE_TRANSFER_BYTES, ProbeSink, run_probe
from ..wire import messages as m
from .admission import Gate

if TYPE_CHECKING:
    from ..peers import Peers
    from ..session import PeerSession


#: Probe transfers a peer may have open here at once (a probe keeps 3 in flight): each is a
#: transfer the peer opens without any engine's post, up to `transfer.max_transfers` before.
MAX_PROBES_IN = 16


def is_probe(request_id: str) -> bool:
    return request_id.startswith(PROBE_PREFIX)


class ProbeDesk:
    def __init__(self, peers: "Peers", gate: Gate, log) -> None:
        self.peers = peers
        self.gate = gate
        self.log = log
        self.sink = ProbeSink()  # stands in for the engine at both ends
        self._region: HostRegion | None = None
        self._filled = False
        self._probing: set[str] = set()
        self._incoming: dict[str, list[int]] = {}  # peer -> its probe transfers open here (ids)

    def _blocks(self, nbytes: int, *, sending: bool = False) -> BlockMap:
        """``nbytes`` (whole MiB) of the scratch region."""
        if self._region is None:
            mem = SharedMemory(PROBE_SCRATCH_BYTES)
            fd = os.dup(mem.fd)
            mem.close()
            self._region = HostRegion(-1, fd, PROBE_SCRATCH_BYTES, 1 << 20, owner=self.sink)
            self._filled = False
        r = self._region
        if sending and not self._filled:
            r.view()[:] = os.urandom(PROBE_SCRATCH_BYTES)
            self._filled = True
        return BlockMap({r.region_id: r}, as_extents([(r.region_id, 0, nbytes >> 20)]))

    def incoming_begin(self, session: "PeerSession", tid: int, begin: m.KvBegin) -> None:
        if begin.total_bytes > PROBE_SCRATCH_BYTES or begin.total_bytes % (1 << 20) or begin.block_bytes != 1 << 20:
            session.reject_in(tid, begin, ErrorCode.SIZE_MISMATCH,
                              f"probe transfers are whole MiB blocks up to {PROBE_SCRATCH_BYTES >> 20} MiB")
            return
        mine = [k for k in self._incoming.pop(session.key, ()) if (t := session.inn.get(k)) and is_probe(t.request_id)]
        if len(mine) >= MAX_PROBES_IN:
            session.reject_in(tid, begin, ErrorCode.TOO_MANY_TRANSFERS,
                              f"at most {MAX_PROBES_IN} probe transfers from a peer at once")
        else:  # the probe sender never compresses (it measures the raw link): an LZ4 chunk is refused
            t = session.accept_in(tid, begin, self.sink, self._blocks(begin.total_bytes), lz4=False)
            if t is not None:
                mine.append(tid)
        if mine:
            self._incoming[session.key] = mine

    async def probe(self, peer: str, seconds: float = 4.0, streams: int | None = None) -> dict:
        """Measure the link to ``peer`` (site or site/node) through the real WAN path."""
        self.gate.check()
        if not 0.2 <= seconds <= 120:
            raise EngineRequestError(f"seconds must be in [0.2, 120], got {seconds}", ErrorCode.BAD_REQUEST)
        if streams is not None and not 1 <= streams <= 64:
            raise EngineRequestError(f"streams must be in 1..64, got {streams}", ErrorCode.BAD_REQUEST)
        session = self.peers.session_for(peer)
        if not session.is_up:
            raise EngineRequestError(f"peer {session.key} is not connected", ErrorCode.PEER_UNREACHABLE)
        if session.key in self._probing:
            raise EngineRequestError(f"a probe of {session.key} is already running", ErrorCode.LIMIT_EXCEEDED)
        self._probing.add(session.key)
        try:
            self.log.info("probe started", peer=session.key, seconds=seconds, streams=streams)
            res = await run_probe(session, self._blocks(PROBE_TRANSFER_BYTES, sending=True), self.sink,
                                  seconds=seconds, streams=streams)
            self.log.info("probe done", **{k: v for k, v in res.items() if k != "peer"}, peer=session.key)
            return res
        finally:
            self._probing.discard(session.key)

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
