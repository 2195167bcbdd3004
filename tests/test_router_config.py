"""The router's TOML config and its command line (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdd_wire.errors import ConfigError
from pdd_wire.router import config as rcfg

GOOD = """
[listen]
address = "127.0.0.1:9000"
[request]
deadline_s = 30
[[pools.P]]
url = "http://10.0.0.1:8100"
engine_socket = "/run/pdd-wire/pdd-wire-A.sock"
site = "A"
[[pools.RLD]]
url = "http://10.0.0.2:8100"
site = "A"
node = "a2"
[[pools.MD]]
url = "http://10.1.0.1:8200"
engine_socket = "/run/pdd-wire/pdd-wire-B.sock"
site = "B"
[[pools.MD]]
url = "http://10.1.0.2:8200"
site = "B"
[choice]
kv_bytes_per_token = 131072
block_tokens = 16
prefix_salt = "Llama-3-8B/torch.bfloat16"
timeout_s = 0.5
"""


def test_a_full_config_reads_back():
    cfg = rcfg.loads(GOOD + "[handoff]\nmin_rld_tokens = 2\nmax_rld_tokens = 2\nmode = \"catch-up\"\n"
                     "[handoff.policy]\ncatchup_gap_tokens = 8\n[rld_load]\ninterval_s = 0.25\n")
    assert (cfg.handoff.min_rld_tokens, cfg.handoff.max_rld_tokens, cfg.handoff.md_ready_s) == (2, 2, 30.0)
    assert cfg.handoff.mode == "catch-up" and cfg.handoff.policy.catchup_gap_tokens == 8
    assert cfg.handoff.policy.busy_load == 0.8 and cfg.rld_load.interval_s == 0.25
    dflt = rcfg.loads(GOOD)
    assert dflt.handoff.max_rld_tokens is None and dflt.handoff.mode == "auto" and dflt.handoff.non_streamed
    assert cfg.pools.RLD[0].max_num_seqs == 0 and dflt.choice.md_candidates == 4
    assert cfg.listen.address == "127.0.0.1:9000" and cfg.request.deadline_s == 30
    assert [m.url for m in cfg.pools.MD] == ["http://10.1.0.1:8200", "http://10.1.0.2:8200"]
    assert cfg.pools.RLD[0].node == "a2" and cfg.pools.P[0].engine_socket.endswith("A.sock")
    assert cfg.choice.timeout_s == 0.5 and cfg.choice.block_tokens == 16
    assert dflt.request.max_inflight == 1024
    assert rcfg.loads(GOOD.replace("deadline_s = 30", "deadline_s = 30\nmax_inflight = 1")).request.max_inflight == 1


def test_the_embedded_default_is_valid_and_fronts_sites_a_and_b():
    cfg = rcfg.default_config()
    assert [m.site for m in cfg.pools.P] == ["A"] and [m.site for m in cfg.pools.MD] == ["B"]
    assert cfg.pools.P[0].engine_socket.endswith("pdd-wire-A.sock")


@pytest.mark.parametrize("text,key,words", [
    ('[listen]\naddres = "x"\n', "listen.addres", "did you mean 'address'"),
    (GOOD.replace("engine_socket =", "engin_socket =", 1), "pools.P[0].engin_socket", "did you mean 'engine_socket'"),
    (GOOD.replace("timeout_s = 0.5", "timeout = 0.5"), "choice.timeout", "did you mean 'timeout_s'"),
    (GOOD.replace("deadline_s = 30", "deadline_s = 0"), "request.deadline_s", "must be > 0"),
    (GOOD.replace('"http://10.0.0.1:8100"', '"10.0.0.1:8100"'), "pools.P[0].url", "not an http(s)://host:port URL"),
    (GOOD.replace('address = "127.0.0.1:9000"', 'address = "nowhere"'), "listen.address", "not host:port"),
    ('[[pools.P]]\nurl = "http://a:1"\n', "pools.MD", "needs at least one member"),
    (GOOD.replace('url = "http://10.1.0.2:8200"\nsite = "B"', 'url = "http://10.1.0.2:8200"'),
     "pools.MD[1].site", "required when choice.ask_agent"),
    (GOOD.replace('site = "A"\nnode = "a2"', 'node = "a2"'), "pools.RLD[0].site", "required when choice.ask_agent"),
    (GOOD.replace("timeout_s = 0.5", "timeout_s = 0"), "choice.timeout_s", "must be > 0"),
    (GOOD + "[handoff]\nmin_rld_tokens = 8\nmax_rld_tokens = 4\n", "handoff.max_rld_tokens",
     "at least handoff.min_rld_tokens"),
    (GOOD + "[handoff]\nmd_ready = 3\n", "handoff.md_ready", "did you mean 'md_ready_s'"),
    (GOOD + "[handoff]\nmode = \"later\"\n", "handoff.mode", "valid: auto, one-shot, catch-up"),
    (GOOD + "[handoff.policy]\ncatchup_gap = 3\n", "handoff.policy.catchup_gap", "did you mean 'catchup_gap_tokens'"),
    (GOOD + "[handoff.policy]\nmax_catchup_rounds = 0\n", "handoff.policy", "max_catchup_rounds: must be >= 1"),
    (GOOD + "[handoff]\nabsorb_s = 0\n", "handoff.absorb_s", "must be > 0"),
    (GOOD + "[handoff]\nrld_silent_s = 0\n", "handoff.rld_silent_s", "must be > 0, got 0"),
    (GOOD.replace("deadline_s = 30", "deadline_s = 30\nbody_s = 0"), "request.body_s", "must be > 0, got 0"),
    (GOOD.replace("deadline_s = 30", "deadline_s = 30\nstream_silent_s = 0"), "request.stream_silent_s",
     "must be > 0, got 0"),
    (GOOD + "[handoff]\ncontinue_s = -1\n", "handoff.continue_s", "must be > 0, got -1"),
    (GOOD.replace("deadline_s = 30", "deadline_s = 30\nmax_inflight = 0"), "request.max_inflight", "must be >= 1"),
    (GOOD.replace("deadline_s = 30", "deadline_s = 30\nmax_inflight = -5"), "request.max_inflight", "must be >= 1"),
    (GOOD.replace("deadline_s = 30", "deadline_s = 30\nmax_inflight = 1.5"), "request.max_inflight", "Expected `int`"),
    (GOOD + "[rld_load]\ninterval_s = -1\n", "rld_load.interval_s", "must be > 0"),
    (GOOD.replace('node = "a2"', 'node = "a2"\nmax_num_seqs = -4'), "pools.RLD[0].max_num_seqs", "must be >= 0"),
    (GOOD.replace('"http://10.0.0.1:8100"', '"http://10.0.0.1:99999"'), "pools.P[0].url",
     "not an http(s)://host:port URL"),
    (GOOD + '[fleet]\netcd = ["http://10.0.0.9:2379"]\n', "fleet.etcd[0]", "reaches etcd over TLS"),
    (GOOD + '[fleet]\netcd = ["HTTP://10.0.0.9:2379"]\n', "fleet.etcd[0]", "reaches etcd over TLS"),
    (GOOD + '[fleet]\netcd = ["HTTPS://10.0.0.9:2379"]\n', "fleet", "fleet.tls.ca: required for the https endpoint"),
    (GOOD + "[choice]\n", "(file)", "not valid TOML"),
    ("listen = 3", "listen", "Expected `object`"),
    ("[listen", "(file)", "not valid TOML"),
])
def test_a_bad_config_names_its_key(text, key, words):
    with pytest.raises(ConfigError) as ei:
        rcfg.loads(text)
    assert ei.value.key == key and words in ei.value.problem, ei.value


def test_plaintext_etcd_only_on_loopback():
    """The router's targets come from etcd's records: reached in plaintext only on this host."""
    for url in ("http://127.0.0.1:2379", "http://localhost:2379", "http://[::1]:2379"):
        assert rcfg.loads(GOOD + f'[fleet]\netcd = ["{url}"]\n').fleet.etcd == [url]


def test_rld_needs_a_site_only_for_the_agents_choice():
    """Only the agent's choice sends requests to RLD (P-RLD, P-RLD-MD): P's connector then sends
    the KV to RLD's ``site`` (without one, to its own ``send_to``: RLD would wait for it)."""
    no_site = GOOD.replace('site = "A"\nnode = "a2"', 'node = "a2"')
    with pytest.raises(ConfigError, match="sends RLD's KV there"):
        rcfg.loads(no_site)
    assert rcfg.loads(no_site + "ask_agent = false\n").pools.RLD[0].site == ""


def test_the_command_line_checks_a_config_and_prints_the_default(tmp_path):
    f = tmp_path / "router.toml"
    f.write_text(GOOD)
    run = [sys.executable, "-c", "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())", "router"]
    ok = subprocess.run([*run, "--config", str(f), "--check"], capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and "P 1, RLD 1, MD 2" in ok.stdout, ok.stderr
    f.write_text('[listen]\naddres = "x"\n')
    bad = subprocess.run([*run, "--config", str(f), "--check"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "did you mean 'address'" in bad.stderr
    dflt = subprocess.run([*run, "--print-default"], capture_output=True, text=True, timeout=60, check=False)
    assert dflt.returncode == 0 and rcfg.loads(dflt.stdout) == rcfg.default_config()


def test_an_address_in_use_is_said_once_and_exits_1(tmp_path):
    """``pdd-wire router`` whose listen address is taken: one line naming it, exit 1, and
    nothing it had opened left to the garbage collector ("Unclosed client session")."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        f = tmp_path / "router.toml"
        f.write_text(GOOD.replace('address = "127.0.0.1:9000"', f'address = "127.0.0.1:{port}"'))
        assert f"127.0.0.1:{port}" in f.read_text()
        run = [sys.executable, "-c", "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())",
               "router", "--config", str(f)]
        r = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Unclosed" not in r.stderr and "Traceback" not in r.stderr, r.stderr
