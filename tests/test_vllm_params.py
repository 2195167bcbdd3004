"""What PddWireConnector accepts (pdd_wire.adapters.vllm_params), without vLLM: its config is
checked at start-up (a ValueError naming the key, with a did-you-mean for an unknown one), and a
request's kv_transfer_params once, when vLLM adds the request (BadParam naming the field: the
request is then not sent, or loads nothing). docs/vllm.md's config table lists every key with
its default. What a bad field does to a running vLLM is tests/test_vllm_serve.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdd_wire.adapters.vllm_params import (
    DEFAULTS,
    BadParam,
    consume_params,
    parse_config,
    produce_params,
    transfer_kind,
)
from pdd_wire.errors import MAX_DURATION_S

ROOT = Path(__file__).resolve().parent.parent
SOCK = {"engine_socket": "/run/pdd-wire/a.sock"}


def test_a_minimal_config_takes_the_documented_defaults():
    cfg = parse_config(SOCK)
    assert cfg.engine_socket == SOCK["engine_socket"]
    assert (cfg.send_to, cfg.lease_s, cfg.deadline_s, cfg.recv_slack_s) == ([], 60.0, 60.0, 5.0)
    assert cfg.max_pinned_blocks is None and cfg.prefix_inventory is True and cfg.staging is False
    assert cfg.staging_mb == 1024 and cfg.site is None and cfg.from_site is None
    # null is the default too; one destination as a string is one destination
    cfg = parse_config({**SOCK, "lease_s": None, "send_to": "B/b1", "max_pinned_blocks": 8})
    assert cfg.lease_s == 60.0 and cfg.send_to == ["B/b1"] and cfg.max_pinned_blocks == 8
    assert parse_config({**SOCK, "send_to": ["A/a2", "A/a3", "B"]}).send_to == ["A/a2", "A/a3", "B"]  # two nodes


@pytest.mark.parametrize("extra, message", [
    pytest.param({}, "kv_connector_extra_config['engine_socket'] (the agent's engine socket) is required",
                 id="no-socket"),
    pytest.param({**SOCK, "lease_s": 0}, "['lease_s']: must be in (0, 604800] seconds, got 0", id="lease-0"),
    pytest.param({**SOCK, "lease_s": -1.5}, "['lease_s']: must be in (0, 604800] seconds", id="lease-negative"),
    pytest.param({**SOCK, "deadline_s": "60"}, "['deadline_s']: must be a number of seconds, got '60'",
                 id="deadline-string"),
    pytest.param({**SOCK, "deadline_s": float("nan")}, "['deadline_s']: must be in (0, 604800]", id="deadline-nan"),
    pytest.param({**SOCK, "recv_slack_s": float("inf")}, "['recv_slack_s']: must be in", id="slack-inf"),
    pytest.param({**SOCK, "lease_s": True}, "['lease_s']: must be a number of seconds, got True", id="lease-bool"),
    pytest.param({**SOCK, "lease_s": 600000, "deadline_s": 60000}, "['deadline_s']: a send's deadline is "
                 "lease_s + deadline_s", id="deadline-sum"),
    pytest.param({**SOCK, "max_pinned_blocks": 0}, "['max_pinned_blocks']: must be a positive integer, got 0",
                 id="pinned-0"),
    pytest.param({**SOCK, "max_pinned_blocks": 2.5}, "['max_pinned_blocks']: must be a positive integer",
                 id="pinned-float"),
    pytest.param({**SOCK, "send_to": ["B", ""]}, "['send_to']: must name destinations as non-empty strings",
                 id="send-to-empty"),
    pytest.param({**SOCK, "send_to": ["B", "B"]}, "['send_to']: names 'B' twice", id="send-to-twice"),
    pytest.param({**SOCK, "send_to": ["B", "B/b1"]}, "['send_to']: names a site and one of its nodes",
                 id="send-to-site-and-its-node"),
    pytest.param({**SOCK, "send_to": {"B": 1}}, "['send_to']: must be a destination", id="send-to-map"),
    pytest.param({**SOCK, "staging": "yes"}, "['staging']: must be true or false, got 'yes'", id="staging-str"),
    pytest.param({**SOCK, "prefix_inventory": 1}, "['prefix_inventory']: must be true or false", id="flag-int"),
    pytest.param({**SOCK, "site": ""}, "['site']: must be a site name", id="site-empty"),
    pytest.param({**SOCK, "engine_socket": 7}, "['engine_socket']: must be a non-empty string", id="socket-int"),
    pytest.param({**SOCK, "lease": 30}, "['lease']: unknown key (did you mean 'lease_s'?)", id="typo"),
    pytest.param({**SOCK, "sendto": ["B"]}, "['sendto']: unknown key (did you mean 'send_to'?)", id="typo-2"),
    pytest.param({**SOCK, "zzz": 1}, "['zzz']: unknown key (known: engine_socket, send_to,", id="unknown"),
    pytest.param(["B"], "kv_connector_extra_config must be a JSON object", id="not-a-map"),
])
def test_a_bad_config_is_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError) as ei:
        parse_config(extra)
    assert str(ei.value).startswith("pdd-wire: ")
    assert message in str(ei.value)


def test_the_docs_list_every_config_key_with_its_default():
    text = (ROOT / "docs" / "vllm.md").read_text()
    table = text.split("## Configuration (`kv_connector_extra_config`)", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))
    assert list(rows) == list(DEFAULTS)
    for key, default in DEFAULTS.items():
        if isinstance(default, (bool, float, int)):
            shown = str(default).lower() if isinstance(default, bool) else f"{default:g}"
            assert rows[key].strip() == f"`{shown}`", (key, rows[key])


@pytest.mark.parametrize("params, producer, consumer, kind", [
    ({"do_remote_decode": True}, True, False, "produce"),
    ({"do_remote_decode": True, "do_remote_prefill": False}, True, False, "produce"),  # the stock proxies
    ({"do_remote_decode": True}, False, True, None),
    ({"do_remote_prefill": True, "pdd_request_id": "r"}, False, True, "consume"),
    ({"do_remote_prefill": True, "pdd_request_id": "r", "send_to": ["B"]}, True, True, "consume"),
    # what a prefill returns when it sent nothing: never a load, in either form
    ({"do_remote_prefill": False, "do_remote_decode": False, "pdd_request_id": "r", "pdd_error": "x"},
     False, True, None),
    ({"do_remote_prefill": False, "do_remote_decode": False, "pdd_request_id": "r"}, False, True, None),
    ({"pdd_request_id": "r", "num_tokens": 3, "send_to": ["B"], "pdd_error": "x"}, False, True, None),
    # the older form
    ({"pdd_request_id": "r", "send_to": ["B"]}, True, False, "produce"),
    ({"pdd_request_id": "r", "send_to": ["B"]}, False, True, "consume"),
    ({"pdd_request_id": "r", "num_tokens": 3}, True, True, "consume"),
    ({"something": 1}, True, True, None),
    (None, True, True, None),
    ("do_remote_decode", True, True, None),
    (["do_remote_decode"], True, True, None),
])
def test_which_side_a_request_is(params, producer, consumer, kind):
    assert transfer_kind(params, producer, consumer) == kind


def test_good_producer_params():
    pp = produce_params({"do_remote_decode": True, "pdd_request_id": "r-1", "send_to": "B/b1", "lease_s": 5,
                         "deadline_s": 2.5})
    assert (pp.rid, pp.to, pp.lease_s, pp.deadline_s) == ("r-1", ["B/b1"], 5.0, 2.5)
    pp = produce_params({"do_remote_decode": True, "send_to": [], "lease_s": None})
    assert (pp.rid, pp.to, pp.lease_s, pp.deadline_s) == (None, None, None, None)  # the defaults


@pytest.mark.parametrize("field, value, message", [
    ("lease_s", "abc", "lease_s must be a number of seconds, got 'abc'"),
    ("lease_s", 0, "lease_s must be in (0, 604800] seconds, got 0"),
    ("lease_s", -3, "lease_s must be in (0, 604800] seconds, got -3"),
    ("lease_s", 10 ** 400, "lease_s must be in (0, 604800] seconds, got 1000000000"),
    ("lease_s", [], "lease_s must be a number of seconds, got []"),
    ("deadline_s", {"x": 1}, "deadline_s must be a number of seconds"),
    ("deadline_s", MAX_DURATION_S + 1, "deadline_s must be in (0, 604800]"),
    ("send_to", 5, "send_to must be a destination (\"site\" or \"site/node\") or a list of them, got 5"),
    ("send_to", ["B", 3], "send_to must name destinations as non-empty strings, got 3"),
    ("send_to", "", "send_to must name destinations as non-empty strings, got ''"),
    ("send_to", ["B", "B"], "send_to names 'B' twice"),
    ("send_to", [f"B/b{i}" for i in range(65)], "send_to names 65 destinations (at most 64)"),
    ("pdd_request_id", 42, "pdd_request_id must be a string, got 42"),
    ("pdd_request_id", "", "pdd_request_id must be 1..256 bytes, got 0"),
    ("pdd_request_id", "x" * 257, "pdd_request_id must be 1..256 bytes, got 257"),
    ("pdd_request_id", "\x00probe/1", "pdd_request_id: request ids starting with a NUL character are reserved"),
    ("pdd_request_id", "a\ud800", "pdd_request_id is not valid UTF-8 (a lone surrogate)"),
])
def test_bad_producer_params_name_the_field(field, value, message):
    with pytest.raises(BadParam) as ei:
        produce_params({"do_remote_decode": True, field: value})
    assert str(ei.value).startswith(message), str(ei.value)
    assert len(str(ei.value)) < 160  # a client's megabytes are not echoed


def test_good_consumer_params():
    cp = consume_params({"do_remote_prefill": True, "pdd_request_id": "r", "num_tokens": 75, "remote_site": "A",
                         "lease_s": 60, "lease_started": 1796083530.123})
    assert (cp.rid, cp.num_tokens, cp.from_site, cp.lease_s, cp.lease_started) == ("r", 75, "A", 60.0,
                                                                                   1796083530.123)
    cp = consume_params({"pdd_request_id": "r", "from_site": "A"})  # the older form: no lease
    assert (cp.num_tokens, cp.from_site, cp.lease_s, cp.lease_started) == (None, "A", None, None)
    assert consume_params({"pdd_request_id": "r", "num_tokens": 0}).num_tokens == 0


@pytest.mark.parametrize("params, message", [
    ({"do_remote_prefill": True}, "pdd_request_id is missing"),
    ({"pdd_request_id": ["r"]}, "pdd_request_id must be a string"),
    ({"pdd_request_id": "r", "num_tokens": "70"}, "num_tokens must be a non-negative integer, got '70'"),
    ({"pdd_request_id": "r", "num_tokens": -1}, "num_tokens must be a non-negative integer, got -1"),
    ({"pdd_request_id": "r", "num_tokens": 70.0}, "num_tokens must be a non-negative integer, got 70.0"),
    ({"pdd_request_id": "r", "num_tokens": True}, "num_tokens must be a non-negative integer, got True"),
    ({"pdd_request_id": "r", "lease_s": "60"}, "lease_s must be a number of seconds"),
    ({"pdd_request_id": "r", "lease_s": float("inf")}, "lease_s must be in (0, 604800]"),
    ({"pdd_request_id": "r", "lease_s": 60, "lease_started": "now"}, "lease_started must be a wall-clock time"),
    ({"pdd_request_id": "r", "lease_s": 60, "lease_started": float("nan")}, "lease_started must be"),
    ({"pdd_request_id": "r", "lease_s": 60, "lease_started": 10 ** 400}, "lease_started must be"),
    ({"pdd_request_id": "r", "remote_site": 5}, "remote_site must be a site name, got 5"),
    ({"pdd_request_id": "r", "from_site": ""}, "from_site must be a site name"),
])
def test_bad_consumer_params_name_the_field(params, message):
    with pytest.raises(BadParam) as ei:
        consume_params(params)
    assert str(ei.value).startswith(message), str(ei.value)
