"""One engine's requests cannot fail the control connection to a peer (proto/transfer.md §10 and
§13, session/outbox.py): the frames they make that no other frame waits for are held back while
the connection has half of ``limits.control_buffer_bytes`` unsent. A PREFIX_QUERY (up to ~590
KB) is then not asked (the transfer sends every block), and an engine's REQUEST_ABORT of a
request it held nothing of is dropped (its reason goes cut to 256 characters anyway). Before,
both went straight onto the connection: 120 ``send_kv`` with 65,537 block hashes, or 3,000
``abort`` with 16 KiB reasons, had the agent fail its control connection to B for
PEER_NOT_READING, and every engine's tokens and transfers with B waited for the reconnect.

Real agents A and B; A reaches B through a shaper at 2 MB/s per connection (a WAN share).
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import metric
from pdd_tools.shaper import Shaper
from pdd_wire.errors import ErrorCode
from support.agents import free_port, run_agents, two_site_toml

MiB = 1 << 20
BUFFER = 8 * MiB  # limits.control_buffer_bytes: the queries and aborts below are far more
HASHES = 65_537


@pytest.mark.parametrize("kind", ["prefix_query", "abort"])
async def test_one_engine_cannot_fail_the_control_connection_to_a_peer(tmp_sock_dir, engines, kind):
    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"]), rate_Bps=2 * MiB) as relay:
        tomls = two_site_toml(tmp_sock_dir, ports=ports, wan_override={"B": f"127.0.0.1:{relay.port}"},
                              extra=f"[limits]\ncontrol_buffer_bytes = {BUFFER}\n", dead_after_s=5.0)
        async with run_agents(tomls) as ag:
            a = ag["A"]
            x = await engines.connect(tmp_sock_dir / "A.sock", "x")
            session = a.sessions["B/b1"]
            if kind == "prefix_query":
                region = await x.register(engines.memory(HASHES), block_bytes=1)
                hashes = [(1 << 63) + i for i in range(HASHES)]  # 9 bytes each: ~590 KB a query
                for k in range(120):
                    await x.send_kv(f"pq-{k}", [region.blocks(0, HASHES)], to=["B"], block_hashes=hashes,
                                    lease_s=60)
                asked = sum(1 for t in session.out.values() if t.hashes is not None)
                assert 0 < asked < 120, asked  # the rest send every block
            else:
                reason = "\U0001F600" * 4096  # 16 KiB of UTF-8: the most the engine socket takes
                await asyncio.gather(*(x.abort(f"ab-{k}", reason) for k in range(3000)))
                # (how many of them the outbox kept or dropped depends on how fast PONGs confirm them)
            assert session.control is not None and session.control.unsent <= BUFFER // 2 + MiB
            await asyncio.sleep(1.0)
            assert metric(a, "pddwire_errors_total", code=ErrorCode.PEER_NOT_READING.name) == 0
            assert metric(a, "pddwire_reconnects_total", peer="B/b1") == 0
            assert session.is_up
