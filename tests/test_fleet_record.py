"""A member's record without etcd: its bounds, its key check, the refresh rule, and the
[fleet] configuration's errors (each names its key), which hold what readers of the record hold
(one rule for both), with ``pdd-wired --check`` refusing a record the agent would refuse."""

from __future__ import annotations

import subprocess
import sys
import time

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


def test_an_unknown_field_nested_too_deep_is_a_refused_record_not_an_error_of_the_reader():
    """About 2 KB under one member's key, a value nested 1,000 deep, raised RecursionError out of
    the reader: a full listing stopped at that key, hiding every member listed after it."""
    raw = encode(record())[:-1] + b', "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert len(raw) < MAX_RECORD_BYTES
    with pytest.raises(RecordError, match="not a MemberRecord"):
        decode(f"{PREFIX}A/a1", raw, PREFIX)


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
    ('etcd = ["http://e1:2379"]', "fleet.advertise", "[::]:7601"),
    ('etcd = ["http://e1:2379"]\nadvertise = "0.0.0.0:7601"', "fleet.advertise", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\nadvertise = "[::]:1"', "fleet.advertise", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\nadvertise = "p17.example:0"', "fleet.advertise", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\n[[fleet.engines]]\nrole = "P"\nurl = "http://:8000"', "fleet.engines[0].url",
     "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\ndial_wait_s = inf', "fleet.dial_wait_s", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\nidle_close_s = inf', "fleet.idle_close_s", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\nrefresh_min_s = inf', "fleet.refresh_min_s", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\ndial_wait_s = nan', "fleet.dial_wait_s", "127.0.0.1:0"),
    ('etcd = ["http://e1:2379"]\ndial_wait_s = 604801', "fleet.dial_wait_s", "127.0.0.1:0"),
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


@pytest.mark.parametrize(("url", "ok"), [
    ("http://10.0.0.2:8200", True), ("https://p17.example", True), ("http://[::1]:8000", True),
    ("http://:8000", False), ("http://", False), ("ftp://h:1", False), ("file:///etc/passwd", False),
    ("http://h:99999", False), ("http://a b:80", False), ("h:8000", False),
])
def test_an_engine_url_the_config_takes_is_one_every_reader_takes(url, ok):
    """fleet.engines[].url and the records read from etcd hold one rule: no member registers a
    record every reader ignores."""
    try:
        fleet_config(f'etcd = ["http://e1:2379"]\n[[fleet.engines]]\nrole = "P"\nurl = "{url}"')
        config_ok = True
    except ConfigError as exc:
        assert exc.key == "fleet.engines[0].url"
        config_ok = False
    try:
        decode(f"{PREFIX}A/a1", encode(record(engines=(EngineRec(role="P", url=url),))), PREFIX)
        reader_ok = True
    except RecordError:
        reader_ok = False
    assert config_ok == reader_ok == ok


@pytest.mark.parametrize("wan", ["0.0.0.0:7601", "[::]:1", "::0:7601", "10.0.0.1:0", "[]:7601"])
def test_a_record_whose_address_no_one_can_dial_is_refused(wan):
    with pytest.raises(RecordError, match="can dial"):
        decode(f"{PREFIX}A/a1", encode(msgspec.structs.replace(record(), wan=wan)), PREFIX)
    with pytest.raises(ConfigError) as exc:  # what fleet.advertise takes, and no more
        fleet_config(f'etcd = ["http://e1:2379"]\nadvertise = "{wan}"')
    assert exc.value.key == "fleet.advertise"


def _check(tmp_path, engines: int, url_bytes: int) -> subprocess.CompletedProcess:
    """``pdd-wired --check`` of a fleet member with ``engines`` engines whose URLs are
    ``url_bytes`` long."""
    host = "e" * (url_bytes - len("http://:8000"))
    toml = (f'site = "A"\nnode = "a1"\n[listen]\nwan = "127.0.0.1:0"\nadmin = "127.0.0.1:0"\n'
            f'engine_socket = "{tmp_path}/a1.sock"\n[fleet]\netcd = ["http://127.0.0.1:9"]\n'
            + "".join(f'[[fleet.engines]]\nrole = "P"\nurl = "http://{host}:{8000 + i}"\n' for i in range(engines)))
    path = tmp_path / "a.toml"
    path.write_text(toml)
    return subprocess.run([sys.executable, "-m", "pdd_wire", "--site", "A", "--config", str(path), "--check"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_check_refuses_a_member_record_over_its_bound(tmp_path):
    """A record the agent would refuse at start (exit 1) fails --check (exit 2) naming
    fleet.engines; the bound is the record at its largest (a certificate's fingerprint, the
    largest incarnation and ports, the longest time), so what --check passes always registers."""
    r = _check(tmp_path, 4, 60)
    assert r.returncode == 0 and "config OK" in r.stdout, r.stderr
    r = _check(tmp_path, 30, 120)
    assert r.returncode == 2 and "'fleet.engines'" in r.stderr and f"over {MAX_RECORD_BYTES}" in r.stderr, r.stderr


def test_the_checked_record_is_the_largest_the_agent_can_write():
    """At the longest URL --check passes, the record the agent writes (its fingerprint,
    incarnation, bound port and registration time) still fits; one byte more fails the check."""
    from pdd_wire.agent import check_member_record, member_record

    def cfg(n: int) -> cfgmod.Config:
        return fleet_config(f'etcd = ["http://e1:2379"]\n[[fleet.engines]]\nrole = "P"\nurl = "http://{"h" * n}:8100"')

    n = MAX_RECORD_BYTES - 600  # the rest of the record is shorter than 600 bytes
    check_member_record(cfg(n))
    while True:
        try:
            check_member_record(cfg(n + 1))
        except ConfigError as exc:
            assert exc.key == "fleet.engines"
            break
        n += 1
    written = member_record(cfg(n), incarnation=(1 << 62) + 12345, wan_port=54321, admin="",
                            fingerprint="sha256:" + "ab" * 32)
    assert MAX_RECORD_BYTES - 8 <= len(encode(msgspec.structs.replace(written, at=time.time()))) <= MAX_RECORD_BYTES
