"""A user-space TCP relay for an emulated WAN and for fault injection: one-way delay, jitter and a
rate limit per direction, and the faults the tests inject (a flipped byte, a cut, a pause, a
link drop, refused connections).

Why: the demo and the fault-injection suite want two "datacenters" 20 ms apart on one machine,
and this kernel has no ``netem`` qdisc (``tbf`` and ``htb`` exist, see :mod:`pdd_tools.netns`,
but neither delays packets nor corrupts them).  So the WAN's latency and its faults are added
here, above TCP: a :class:`Shaper` listens on ``listen`` and, for every accepted connection,
connects to ``target`` and copies bytes both ways.  "c2s" is the direction from whoever
connected to the shaper to the target, "s2c" the other one; stream offsets are counted per
connection and per direction from 0.

Each chunk read from one side gets a due time and is written to the other side no earlier:

* rate (optional, bytes/s): a token bucket, run as a virtual clock (GCRA): the chunk's last
  byte "leaves the bottleneck" at ``tx = max(tx_prev, now - burst/rate) + size/rate``, so after
  an idle spell up to ``burst`` bytes (5 ms of the rate, at least 16 KiB) pass at once and the
  long-run rate never exceeds ``rate``.  Chunks are cut to at most ``quantum`` bytes (1 ms of
  the rate, within 4-64 KiB) first, so the receiver sees a smooth stream, not 256 KiB lumps;
* delay and jitter: then ``due = max(tx, now) + delay + j``, where ``j`` is uniform in
  ``[-jitter, +jitter]`` or normal with sigma ``jitter``, never below ``-delay``;
* order: ``due = max(due, due of the previous chunk)``, so bytes are never reordered within a
  connection; with jitter, the mean added delay is therefore a little above ``delay``.

Faults, set at any time, apply to the live connections and to later ones:

* :meth:`Shaper.flip_byte_at`: corrupt one byte (xor 0xFF) at a stream offset, once;
* :meth:`Shaper.cut_after`: reset a connection once a stream passes an offset;
* :meth:`Shaper.pause` / :meth:`Shaper.resume`: stop / restart forwarding;
* :meth:`Shaper.abort_all`: reset every live connection (link drop);
* :meth:`Shaper.reject_new`: reset new connections as soon as they arrive (link down).

Memory is bounded: a side stops being read while more than ``queue_limit`` bytes wait in its
delay queue (reading resumes below half of it), while the transport it feeds is paused for
writing (``pause_writing`` / ``resume_writing``) and while the shaper is paused.  Throughput
under delay is thus capped at about ``queue_limit / delay`` (8 MiB / 20 ms = 400 MiB/s by
default); kernel socket buffers add to what is in flight.  EOF is forwarded, in order and
delayed like data, as a half-close; a reset on one side is passed on at once as a reset on the
other.  "Reset" always means a real RST: SO_LINGER is set to (on, 0) before
``transport.abort()``, since ``abort()`` alone closes the socket with a FIN.

Settings can be changed at any time (:meth:`Shaper.set_delay`, :meth:`Shaper.set_rate`) and
apply to the chunks read from then on, on live connections too.  Only loopback and private
addresses (127/8, 10/8, 172.16/12, 192.168/16, ::1) may be listened on or targeted: this is a
test tool and must never relay to, or be reachable from, the outside.  Pure asyncio protocols:
it runs on the default loop and on uvloop.

CLI: ``python -m pdd_tools.shaper --listen HOST:PORT --target HOST:PORT --delay-ms 20
--jitter-ms 2 [--rate-mbit N]`` runs until SIGTERM or SIGINT, then exits 0; a bad argument
exits 2 naming it; a listen address that cannot be bound exits 1.  Once listening it prints
``shaper listening on HOST:PORT -> HOST:PORT`` on stdout (the real port when PORT was 0).

Modules: :mod:`~pdd_tools.shaper.relay` (:class:`Shaper`: listening, settings, faults),
:mod:`~pdd_tools.shaper.conn` (:class:`ShapedConn`: one relayed connection's data path),
:mod:`~pdd_tools.shaper.link` (what the connections of one shaper share; address checks),
:mod:`~pdd_tools.shaper.cli` (the command line).
"""

from .conn import ShapedConn
from .link import QUEUE_LIMIT, check_address
from .relay import Shaper, ShaperStats

__all__ = ["QUEUE_LIMIT", "ShapedConn", "Shaper", "ShaperStats", "check_address"]
