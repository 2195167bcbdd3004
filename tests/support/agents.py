"""Real agents for tests, in-process on the test's loop (subprocess agents: pdd_tools.harness)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from pdd_tools.harness import free_port  # noqa: F401 - tests import it from here
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent


def two_site_toml(tmp: Path, *, streams: int = 4, chunk: int = 4 << 20, extra: str = "",
                  wan_override: dict | None = None, tls: dict | None = None,
                  ports: dict | None = None, plaintext: bool = False, dead_after_s: float = 1.5) -> dict[str, str]:
    """TOML texts for sites A (node a1) and B (node b1) on loopback, free ports.
    ``wan_override[site]`` replaces the address the *other* site dials (e.g. a relay).
    Peers authenticate: ``tls`` certificates, else the PKI the agents generate in the shared
    directory; ``plaintext``: neither (tls.allow_plaintext). ``dead_after_s``: a peer silent this
    long is dropped (short, for the tests of it; tests beside vLLM servers, whose loop those
    servers may starve on a loaded machine, give it longer: see :data:`BESIDE_VLLM_DEAD_AFTER_S`)."""
    ports = ports or {"A": free_port(), "B": free_port()}
    out = {}
    for site, node, other, onode in (("A", "a1", "B", "b1"), ("B", "b1", "A", "a1")):
        addr = (wan_override or {}).get(other, f"127.0.0.1:{ports[other]}")
        tls_txt = "[tls]\nallow_plaintext = true\n" if plaintext else ""
        if tls:
            cert, key = tls[node]
            ca = tls.get(f"ca_{node}", tls["ca"])  # a node of its own CA (a rogue peer trusts its own)
            tls_txt = f'[tls]\ncert = "{cert}"\nkey = "{key}"\nca = "{ca}"\n'
        out[site] = f"""
site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{ports[site]}"
admin = "127.0.0.1:0"
engine_socket = "{tmp}/{site}.sock"
[[peers]]
site = "{other}"
node = "{onode}"
address = "{addr}"
streams = {streams}
[transfer]
chunk_bytes = {chunk}
[timeouts]
heartbeat_s = 0.2
dead_after_s = {dead_after_s}
reconnect_max_backoff_s = 0.2
shutdown_grace_s = 2
{tls_txt}
{extra}
"""
    out["ports"] = ports
    return out


# In-process agents beside vLLM servers: the servers' processes spin (a busy server takes about
# 1.5 cores) and, on a loaded 2-core machine, may starve the test's loop for seconds; 1.5 s of
# missed heartbeats there dropped every session, and the reconnections' TLS handshakes (CPU, on
# the same starved loop) made the stall longer (CI: 24 s, a router request timed out). The
# servers run niced, their sessions' scheduler groups too (pdd_tools.vllm.serve.nice_session:
# with autogroups, nice alone did not lower them), and a stall of this process is logged with
# its stack (pdd_wire.loopwatch). Those tests check KV, tokens and handoffs, not the detection
# of a silent peer (tests/test_robustness.py and the session tests do, at 1.5 s).
BESIDE_VLLM_DEAD_AFTER_S = 20.0


@contextlib.asynccontextmanager
async def run_agents(tomls: dict, sites=("A", "B"), wait_up: bool = True):
    agents = {}
    try:
        for s in (sites if set(sites) <= set(tomls) else [k for k in tomls if k != "ports"]):
            a = Agent(cfgmod.loads(tomls[s]))
            await a.start()
            agents[s] = a
        if wait_up:
            async with asyncio.timeout(10):
                for a in agents.values():
                    for sess in a.sessions.values():
                        while not (sess.is_up and len(sess.links) == sess.streams):
                            await asyncio.sleep(0.01)
        yield agents
    finally:
        for a in agents.values():
            await a.shutdown(0)



@contextlib.asynccontextmanager
async def running(*tomls: str):
    """Agents of these configurations, started in order and stopped at the end."""
    agents = []
    try:
        for t in tomls:
            a = Agent(cfgmod.loads(t))
            await a.start()
            agents.append(a)
        yield agents
    finally:
        for a in agents:
            await a.shutdown(0)

async def wait_links(agent: Agent, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        for sess in agent.sessions.values():
            while not (sess.is_up and len(sess.links) == sess.streams):
                await asyncio.sleep(0.01)


def cluster_toml(tmp: Path, nodes: list[tuple[str, str]], *, local_transport: str = "tcp", streams: int = 4,
                 extra: str = "", ports: dict[str, int] | None = None,
                 dial: dict[tuple[str, str], int] | None = None, dead_after_s: float = 1.5) -> dict[str, str]:
    """TOML texts keyed by node name, every agent a peer of every other; same-site peers use
    ``local_transport``. Sockets are ``tmp/<node>.sock``. ``dial[(node, peer)]``: the port
    ``node`` dials to reach ``peer`` (a fault relay in front of it). ``dead_after_s``: as in
    :func:`two_site_toml`."""
    ports = ports or {n: free_port() for _, n in nodes}
    dial = dial or {}
    out = {}
    for site, node in nodes:
        peers = "".join(
            f'[[peers]]\nsite = "{s}"\nnode = "{n}"\naddress = "127.0.0.1:{dial.get((node, n), ports[n])}"\n'
            f'transport = "{local_transport if s == site else "tcp"}"\nstreams = {streams}\n\n'
            for s, n in nodes if n != node)
        out[node] = f"""
site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{ports[node]}"
admin = "127.0.0.1:0"
engine_socket = "{tmp}/{node}.sock"
{peers}
[timeouts]
heartbeat_s = 0.2
dead_after_s = {dead_after_s}
reconnect_max_backoff_s = 0.2
shutdown_grace_s = 2
{extra}
"""
    return out


@contextlib.asynccontextmanager
async def relayed_toml(tmp: Path, *, transfer: str = ""):
    """A fault-injecting relay in front of B (A dials B through it: A->B is the relay's c2s) and
    the two agents' TOML; ``transfer`` adds lines to both [transfer] tables."""
    from pdd_tools.shaper import Shaper

    ports = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", ports["B"])) as relay:
        tomls = two_site_toml(tmp, ports=ports, wan_override={"B": f"127.0.0.1:{relay.port}"})
        if transfer:
            tomls = {k: (v.replace("[transfer]\n", f"[transfer]\n{transfer}\n") if k in "AB" else v)
                     for k, v in tomls.items()}
        yield relay, tomls

