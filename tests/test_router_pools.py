"""The router's live pools and its reading of vLLM's load gauges (no vLLM needed; the
P-RLD-MD tests read a real server's page: tests/test_router_pdd.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge

from pdd_wire.router.config import Member
from pdd_wire.router.load import parse_load
from pdd_wire.router.pools import NoMember, Pools


def test_members_come_and_go_while_requests_keep_theirs():
    reg = CollectorRegistry()
    gauge = Gauge("inflight", "", ["pool", "member"], registry=reg)
    seen = []
    pools = Pools(gauge, lambda role, u, added: seen.append((role, u.url, added)))
    a = pools.add("MD", Member(url="http://a:1/"))
    b = pools.add("MD", Member(url="http://b:1"))
    assert [u.url for u in pools.members("MD")] == ["http://a:1", "http://b:1"] and pools.members("RLD") == []
    with pools.using(pools.pick("MD")) as first:
        assert pools.pick("MD") is not first  # least-loaded
        assert reg.get_sample_value("inflight", {"pool": "MD", "member": first.url}) == 1
        assert pools.remove("MD", first.url) is first and first.removed
        assert pools.members("MD") == [b if first is a else a]  # new requests no longer pick it
        assert reg.get_sample_value("inflight", {"pool": "MD", "member": first.url}) == 1  # its request runs on
    assert reg.get_sample_value("inflight", {"pool": "MD", "member": first.url}) is None  # gone with its last
    assert pools.remove("MD", "http://nowhere:1") is None
    again = pools.add("MD", Member(url=first.url))
    assert again is not first and len(pools.members("MD")) == 2
    assert seen == [("MD", "http://a:1", True), ("MD", "http://b:1", True), ("MD", first.url, False),
                    ("MD", first.url, True)]
    with pytest.raises(ValueError, match="no pool 'D'"):
        pools.members("D")
    pools.remove("MD", a.url), pools.remove("MD", b.url)
    with pytest.raises(NoMember, match="pool MD has no member"):
        pools.pick("MD")


def test_equals_are_picked_in_turn():
    pools = Pools()
    for i in range(3):
        pools.add("P", Member(url=f"http://p{i}:1"))
    assert {pools.pick("P").url for _ in range(3)} == {"http://p0:1", "http://p1:1", "http://p2:1"}


PAGE = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_requests_running_total 99.0
"""


def test_the_load_is_slots_or_kv_use_whichever_is_higher():
    load = parse_load(PAGE, 8)
    assert (load.running, load.waiting, load.kv_usage, load.value) == (4.0, 0.0, 0.25, 0.5)
    assert parse_load(PAGE, 64).value == 0.25  # the KV cache is the tighter
    assert parse_load(PAGE, 0).value == 0.25  # slots unknown: the KV cache use
    waiting = PAGE.replace(b'waiting{engine="0",model_name="tiny"} 0.0', b'waiting{engine="0",model_name="tiny"} 2.0')
    assert parse_load(waiting, 0).value == 1.0 and parse_load(waiting, 4).value == 1.5
    with pytest.raises(ValueError, match="no vllm:kv_cache_usage_perc"):
        parse_load(PAGE.replace(b"kv_cache_usage_perc", b"other"), 8)
