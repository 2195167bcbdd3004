"""The router's pools from the fleet: real etcd (one member), real agents registering their
engines, the router watching; engines joining and leaving change the pools without a restart,
and a request meets the empty pool named. No vLLM here: what is under test is who is in the pools."""

from __future__ import annotations

import os
import signal

import aiohttp
import pytest

from conftest import until
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.router import config as rcfg
from pdd_wire.router.discovery import discovered
from pdd_wire.router.server import Router
from support.agents import free_port
from support.fleet import etcd_cluster, spawn_agent


@pytest.fixture(scope="module")
def etcd():
    yield from etcd_cluster(1)


def agent_toml(tmp, site: str, node: str, endpoints: list[str], engines: list[tuple[str, str]]) -> str:
    eps = ", ".join(f'"{e}"' for e in endpoints)
    eng = "".join(f'[[fleet.engines]]\nrole = "{r}"\nurl = "{u}"\n' for r, u in engines)
    return f"""
site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{free_port()}"
admin = "127.0.0.1:0"
engine_socket = "{tmp}/{node}.sock"
[fleet]
etcd = [{eps}]
cluster = "router-{os.getpid()}"
lease_ttl_s = 2
{eng}"""


def router_toml(endpoints: list[str]) -> str:
    eps = ", ".join(f'"{e}"' for e in endpoints)
    return f"""
[listen]
address = "127.0.0.1:0"
[fleet]
etcd = [{eps}]
cluster = "router-{os.getpid()}"
"""


def urls(router: Router, role: str) -> set[str]:
    return {u.url for u in router.pools.members(role)}


async def test_pools_follow_the_fleet(tmp_sock_dir, etcd):
    cfg = rcfg.loads(router_toml(etcd.endpoints))  # no [[pools.*]]: all from etcd
    router = await Router(cfg).start()
    agents: list[Agent] = []
    procs = []
    try:
        async with discovered(router, cfg.fleet) as d:
            await d.membership.listed.wait()
            async with aiohttp.ClientSession() as http:  # nothing registered yet: the empty pool, named
                async with http.post(f"{router.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                    assert r.status == 502 and "pool P has no member" in (await r.json())["error"]["message"]
            # p1 is a pdd-wired process (killed below); p2 and m1 run in this process
            p1 = spawn_agent(tmp_sock_dir, agent_toml(tmp_sock_dir, "A", "p1", etcd.endpoints,
                                                      [("P", "http://127.0.0.1:18100")]), "A", "p1")
            procs.append(p1)
            for site, node, engines in (("A", "p2", [("P", "http://127.0.0.1:18101"), ("RLD", "http://127.0.0.1:18102")]),
                                        ("B", "m1", [("MD", "http://127.0.0.1:18200")])):
                a = Agent(cfgmod.loads(agent_toml(tmp_sock_dir, site, node, etcd.endpoints, engines)))
                await a.start()
                agents.append(a)
            await until(lambda: urls(router, "P") == {"http://127.0.0.1:18100", "http://127.0.0.1:18101"}
                        and urls(router, "RLD") == {"http://127.0.0.1:18102"}
                        and urls(router, "MD") == {"http://127.0.0.1:18200"}, 10, "every engine in its pool")
            await until(lambda: "B/m1" in d.membership.live, 5, "the router reads the members' live figures too")
            md = router.pools.members("MD")[0].member
            assert (md.site, md.node, md.engine_socket) == ("B", "m1", agents[1].config.listen.engine_socket)
            # p2 leaves (its lease is revoked as it stops); p1 is killed (its lease expires)
            await agents.pop(0).shutdown(0)
            await until(lambda: urls(router, "P") == {"http://127.0.0.1:18100"} and not urls(router, "RLD"), 10,
                        "p2's engines gone")
            os.kill(p1.pid, signal.SIGKILL)
            await until(lambda: not urls(router, "P"), 10, "p1 gone once its lease expired")
            assert router.metrics.registry.get_sample_value("pddwire_fleet_member_events_total",
                                                            {"kind": "leave"}) == 2
    finally:
        await router.stop()
        for a in agents:
            await a.shutdown(0)
        for p in procs:
            p.kill()
            p.wait()
