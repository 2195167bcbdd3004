"""A member's record without etcd: its bounds, its key check, the refresh rule, and the
[fleet] configuration's errors (each names its key)."""

from __future__ import annotations

import msgspec
import pytest

from pdd_wire import config as cfgmod
from pdd_wire.errors import ConfigError
from pdd_wire.fleet.record import (
    MAX_LINKS,
    MAX_RECORD_BYTES,
    EngineRec,
    LinkRec,
    Live,
    LiveRecord,
    MemberRecord,
    RecordError,
    decode,
    encode,
    live_prefix,
    members_prefix,
    should_refresh,
)

PREFIX = members_prefix("c1")
LIVE = live_prefix("c1")


def record(**kw) -> MemberRecord:
    return MemberRecord(site="A", node="a1", incarnation=7, wan="10.0.0.1:7601", **kw)


def test_records_round_trip_and_the_live_one_keeps_its_busiest_links():
    rec = record(engines=(EngineRec(role="P", url="http://10.0.0.1:8100"),))
    assert decode(f"{PREFIX}A/a1", encode(rec), PREFIX) == rec
    links = tuple(LinkRec(f"B/b{i}", float(i) * 1e8, 0.03) for i in range(40))
    live = LiveRecord(site="A", node="a1", live=Live(transfers=3, links=links))
    back = decode(f"{LIVE}A/a1", encode(live), LIVE, LiveRecord)
    assert len(back.live.links) == MAX_LINKS
    assert {lk.peer for lk in back.live.links} == {f"B/b{i}" for i in range(40 - MAX_LINKS, 40)}
    assert back.live.transfers == 3


def test_a_record_over_its_bound_is_refused_by_its_writer_and_ignored_by_readers():
    fat = record(engines=tuple(EngineRec(role="P", url=f"http://{'x' * 200}:{i}") for i in range(30)))
    with pytest.raises(ValueError, match=f"over {MAX_RECORD_BYTES}"):
        encode(fat)
    with pytest.raises(RecordError, match="over"):
        decode(f"{PREFIX}A/a1", msgspec.json.encode(fat), PREFIX)


def test_a_record_under_another_members_key_is_refused():
    with pytest.raises(RecordError, match="not its key"):
        decode(f"{PREFIX}A/a2", encode(record()), PREFIX)
    with pytest.raises(RecordError, match="not a MemberRecord"):
        decode(f"{PREFIX}A/a1", b'{"site": 5}', PREFIX)
    with pytest.raises(RecordError, match="record version 2"):
        decode(f"{PREFIX}A/a1", encode(msgspec.structs.replace(record(), v=2)), PREFIX)


def test_unknown_fields_of_a_newer_writer_are_ignored():
    raw = msgspec.json.encode(msgspec.json.decode(encode(record())) | {"gpu_kind": "H200"})
    assert decode(f"{PREFIX}A/a1", raw, PREFIX).node == "a1"


def test_the_refresh_rule_bounds_rate_and_ignores_small_moves():
    a = Live(transfers=10, queue_bytes=100 << 20, links=(LinkRec("B/b1", 1e9, 0.030),))
    small = Live(transfers=11, queue_bytes=110 << 20, links=(LinkRec("B/b1", 1.1e9, 0.031),))
    big = Live(transfers=20, queue_bytes=100 << 20, links=(LinkRec("B/b1", 1e9, 0.030),))
    new_link = Live(transfers=10, queue_bytes=100 << 20, links=a.links + (LinkRec("B/b2", 1e9, 0.03),))
    assert not should_refresh(a, small, 60, min_s=10, change=0.25)  # under 25 %
    assert should_refresh(a, big, 60, min_s=10, change=0.25)
    assert not should_refresh(a, big, 9.9, min_s=10, change=0.25)  # not before refresh_min_s
    assert should_refresh(a, new_link, 10, min_s=10, change=0.25)
    assert not should_refresh(Live(), Live(queue_bytes=100 << 10), 60, min_s=10, change=0.25)  # under the floor


def fleet_config(fleet: str, wan: str = "127.0.0.1:0") -> cfgmod.Config:
    return cfgmod.loads(f'site = "A"\nnode = "a1"\n[listen]\nwan = "{wan}"\nadmin = ""\n'
                        f'engine_socket = "/tmp/x.sock"\n[fleet]\n{fleet}\n')


@pytest.mark.parametrize(("fleet", "key", "wan"), [
    ('etcd = ["127.0.0.1:2379"]', "fleet.etcd[0]", "127.0.0.1:0"),
    ('etcd = ["https://e1:2379"]', "fleet.tls.ca", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\nlease_ttl_s = 1', "fleet.lease_ttl_s", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\ncluster = "a/b"', "fleet.cluster", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]', "fleet.advertise", "0.0.0.0:7601"),
    ('etcd = ["http://e1:2379"]\n[[fleet.engines]]\nrole = "D"\nurl = "http://x:1"', "fleet.engines[0].role",
     "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\nidle_close = 5', "fleet.idle_close", "127.0.0.1:0"),
])
def test_fleet_config_errors_name_the_key(fleet, key, wan):
    with pytest.raises(ConfigError) as exc:
        fleet_config(fleet, wan)
    assert exc.value.key == key, str(exc.value)


def test_a_fleet_config_loads():
    cfg = fleet_config('etcd = ["http://e1:2379", "http://e2:2379"]\ncluster = "prod"\n'
                       '[[fleet.engines]]\nrole = "MD"\nurl = "http://10.0.0.2:8200"')
    assert cfg.fleet.enabled and cfg.fleet.engines[0].role == "MD" and cfg.peers == []
    assert not cfgmod.default_config("A").fleet.enabled  # the embedded default has no fleet
