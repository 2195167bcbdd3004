"""The router's pools from the fleet: real etcd (one member), real agents registering their
engines, the router watching; engines joining and leaving change the pools without a restart,
and a request meets the empty pool named; an engine URL several owners name (the file, two
members) stays while any owner is left; the router's [fleet] table is checked like an agent's.
No vLLM here: what is under test is who is in the pools."""

from __future__ import annotations

import os
import signal

import aiohttp
import pytest

from conftest import until
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.errors import ConfigError
from pdd_wire.fleet.record import EngineRec, MemberRecord, encode, member_key
from pdd_wire.router import config as rcfg
from pdd_wire.router.discovery import PoolDiscovery, discovered
from pdd_wire.router.pools import Pools
from pdd_wire.router.server import Router
from support.agents import free_port
from support.fleet import etcd_client, spawn_agent


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


def router_toml(endpoints: list[str], cluster: str = "", extra: str = "") -> str:
    eps = ", ".join(f'"{e}"' for e in endpoints)
    return f"""
[listen]
address = "127.0.0.1:0"
{extra}
[fleet]
etcd = [{eps}]
cluster = "{cluster or f'router-{os.getpid()}'}"
"""


def urls(router: Router | Pools, role: str) -> set[str]:
    pools = router.pools if isinstance(router, Router) else router
    return {u.url for u in pools.members(role)}


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
            assert [v.name for v in d.membership.views] == ["members"]  # the live/ figures: not watched
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


async def test_an_engine_url_stays_while_any_of_its_owners_is_left(etcd):
    """http://127.0.0.1:18300 is in the file's P pool and registered by two members; :18301 by two
    members only. Members leaving one by one: a URL leaves the pool only with its last owner, and
    the file's entry is never replaced or removed."""
    cluster = f"router-own-{os.getpid()}"
    cfg = rcfg.loads(router_toml(etcd.endpoints, cluster, '[[pools.P]]\nurl = "http://127.0.0.1:18300"\n'
                                 'engine_socket = "/from/the/file.sock"'))
    pools = Pools.from_config(cfg.pools)
    d = PoolDiscovery(cfg.fleet, pools)

    def entries(url: str) -> list:
        return [u.member for u in pools.members("P") if u.url == url]

    await d.start()
    try:
        async with etcd_client(etcd) as client:
            await d.membership.listed.wait()
            for i, node in enumerate(("p1", "p2", "p3")):
                urls_ = {"p1": ["18300", "18301"], "p2": ["18300"], "p3": ["18301"]}[node]
                rec = MemberRecord(site="A", node=node, incarnation=1, wan=f"127.0.0.1:{7600 + i}",
                                   engines=tuple(EngineRec(role="P", url=f"http://127.0.0.1:{u}",
                                                           engine_socket=f"/{node}.sock") for u in urls_))
                await client.put(member_key(cluster, "A", node), encode(rec))
            await until(lambda: len(d.membership.members) == 3, 5, "three members listed")
            assert urls(pools, "P") == {"http://127.0.0.1:18300", "http://127.0.0.1:18301"}
            assert [m.engine_socket for m in entries("http://127.0.0.1:18300")] == ["/from/the/file.sock"]
            for node, left in (("p1", {"18300", "18301"}), ("p3", {"18300"}), ("p2", {"18300"})):
                await client.delete(member_key(cluster, "A", node))
                await until(lambda n=node: f"A/{n}" not in d.membership.members, 5, f"{node} left")
                assert urls(pools, "P") == {f"http://127.0.0.1:{u}" for u in left}, node
                assert [m.engine_socket for m in entries("http://127.0.0.1:18300")] == ["/from/the/file.sock"]
                if node == "p1":  # :18301 now p3's entry
                    assert [m.node for m in entries("http://127.0.0.1:18301")] == ["p3"]
    finally:
        await d.stop()


@pytest.mark.parametrize("fleet, key", [
    ('etcd = ["https://127.0.0.1:2379"]', "fleet.tls.ca"),  # TLS without etcd's CA: never unverified
    ('etcd = ["127.0.0.1:2379"]', "fleet.etcd[0]"),
    ('etcd = ["http://127.0.0.1:2379"]\ncluster = "a b"', "fleet.cluster"),
    ('etcd = ["http://127.0.0.1:2379"]\nrequest_s = 0', "fleet.request_s"),
    ('etcd = ["http://127.0.0.1:2379"]\n[fleet.tls]\ncert = "/etc/hostname"', "fleet.tls"),
])
def test_the_routers_fleet_table_is_checked(fleet, key):
    with pytest.raises(ConfigError) as exc:
        rcfg.loads(f'[listen]\naddress = "127.0.0.1:0"\n[fleet]\n{fleet}\n')
    assert key in str(exc.value), str(exc.value)
