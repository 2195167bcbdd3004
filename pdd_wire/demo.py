"""The quick-start demo: agents for sites A and B on the embedded default config, one sample
request's KV and token IDs moved between them through the engine socket."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from .engine import protocol as p
from .engine.client import EngineClient
from .harness import AgentPair, metric_value
from .memory import SharedMemory

MiB = 1 << 20


async def _demo(mib: int, keep: bool) -> int:
    size = mib * MiB
    block = 2 * MiB
    out_dir = os.path.abspath("demo-out")
    os.makedirs(out_dir, exist_ok=True)
    print(f"starting pdd-wired --site A and --site B (embedded default, loopback); logs in {out_dir}/")
    async with AgentPair(embedded=True, log_dir=out_dir) as pair:
        print(f"  site A: engine socket {pair.sockets['A']}, admin http://{pair.admin['A']}")
        print(f"  site B: engine socket {pair.sockets['B']}, admin http://{pair.admin['B']}")
        async with EngineClient(pair.sockets["A"], "demo-prefill") as prefill, \
                EngineClient(pair.sockets["B"], "demo-decode") as decode:
            with SharedMemory(size) as kv_a, SharedMemory(size) as kv_b:
                kv_a.buf[:] = os.urandom(size)
                ra = await prefill.register(kv_a, block_bytes=block)
                rb = await decode.register(kv_b, block_bytes=block)
                n = size // block
                rid = "demo-req-1"
                print(f"\nrequest {rid}: {mib} MiB of KV ({n} blocks of {block // MiB} MiB), "
                      f"about {size // (32 * 1024)} tokens at 32 KiB/token")
                await decode.post_recv(rid, [rb.blocks(0, n)], from_site="A")
                t0 = time.perf_counter()
                await prefill.send_kv(rid, [ra.blocks(0, n)], to=["B"])
                # The relay decoder streams its first tokens while the KV is still moving.
                tokens = list(range(1000, 1100))
                t_tok = time.perf_counter()
                await prefill.send_tokens(rid, "B", tokens)
                got = []
                while len(got) < len(tokens):
                    ev = await decode.wait_tokens(rid, timeout=30)
                    got += ev.tokens
                tok_ms = (time.perf_counter() - t_tok) * 1e3
                tok_at = (time.perf_counter() - t0) * 1e3
                ev = await decode.wait(rid, timeout=120)
                dt = time.perf_counter() - t0
                if not isinstance(ev, p.KvReceived):
                    print(f"transfer failed: {ev}", file=sys.stderr)
                    return 1
                sent = await prefill.wait(rid, timeout=30)
                same = kv_a.buf == kv_b.buf
                print(f"  KV   A -> B  {size / 1e6:9.1f} MB in {dt * 1e3:7.1f} ms = {size / dt / 1e9:5.2f} GB/s "
                      f"({'byte-identical' if same else 'MISMATCH'}); sender told: {type(sent).__name__}")
                print(f"  tokens A -> B  {len(got)} token IDs in {tok_ms:.2f} ms, in order: {got == tokens}; "
                      f"sent after the KV started, all in {tok_at:.1f} ms after it started, "
                      f"the KV done at {dt * 1e3:.1f} ms")
                m_a, m_b = pair.metrics("A"), pair.metrics("B")
                kv_bytes = metric_value(m_a, "pddwire_bytes_total", direction="tx", lane="bulk")
                chunks = metric_value(m_a, "pddwire_chunks_total", direction="tx")
                streams = pair.status("A")["peers"][0]["bulk_streams_up"]
                bad = metric_value(m_b, "pddwire_checksum_failures_total")
                again = metric_value(m_a, "pddwire_retransmits_total")
                print(f"  wire: A sent {kv_bytes:.0f} KV bytes in {chunks:.0f} chunks over {streams} bulk "
                      f"connections; checksum failures {bad:.0f}, retransmits {again:.0f}")
                print("\nwhere to look:")
                for s in "AB":
                    print(f"  curl http://{pair.admin[s]}/metrics     curl http://{pair.admin[s]}/v1/status")
                print("  pdd-wire status --site A")
                print(f"  agent logs (JSON lines): {out_dir}/agent-A.log, {out_dir}/agent-B.log")
                ok = same and got == tokens
                if keep:
                    print("\nagents keep running (--keep); Ctrl-C stops them")
                    try:
                        await asyncio.Event().wait()
                    except asyncio.CancelledError:
                        pass
                else:
                    print("(the agents stop with the demo; scripts/demo --keep leaves them up until Ctrl-C)")
                return 0 if ok else 1


def run_demo(args) -> int:
    import uvloop

    try:
        return uvloop.run(_demo(args.mib, args.keep))
    except KeyboardInterrupt:
        return 0
