"""The ucx benchmark group's profile step (pdd_tools.bench_ucx_agents): py-spy's raw samples
sorted into the categories the figures name."""

from __future__ import annotations

from pdd_tools import bench_ucx_agents

# Three stacks as py-spy record --format raw writes them (taken from a sampled agent): frames
# outermost first, separated by ";", then the sample count.
RAW = """\
<module> (pdd_wire/__main__.py:5);daemon_main (pdd_wire/cli.py:64);Runner.run (asyncio/runners.py:118);\
FrameProtocol.buffer_updated (pdd_wire/transport/tcp.py:217);PeerSession._on_control_frame \
(pdd_wire/session/peer.py:347);Sender.on_done (pdd_wire/session/sending.py:211);Histogram.observe \
(prometheus_client/metrics.py:681);MutexValue.inc (prometheus_client/values.py:28) 2
<module> (pdd_wire/__main__.py:5);daemon_main (pdd_wire/cli.py:64);Op._end (pdd_wire/transport/ucx_recv.py:110);\
UcxDataPath._landed (pdd_wire/transport/ucx_path.py:181);Receiver.chunk_arrived (pdd_wire/session/receiving.py:122);\
PeerSession.send_frame (pdd_wire/session/peer.py:391);FrameProtocol.send (pdd_wire/transport/tcp.py:245) 3
<module> (pdd_wire/__main__.py:5);daemon_main (pdd_wire/cli.py:64);Runner.run (asyncio/runners.py:118) 5
not a sample line
"""


def test_profile_samples_go_to_their_innermost_category():
    total, per = bench_ucx_agents.categorize(RAW)
    assert total == 10
    assert per == {"prometheus metrics": 2, "control frames out (encode, TLS, write)": 3,
                   "event loop (uvloop, asyncio)": 5}
