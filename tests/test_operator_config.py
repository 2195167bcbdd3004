"""What an operator meets first, held against real ``pdd-wired`` / ``pdd-wire`` processes:
``--check`` applies the agent's directory rule read only and names the key or environment
variable that chose the directory, TLS keys without a certificate, every duration bounded, the
full dotted key in every range error (and that range written in the reference table), the
tool's flags and messages, and ``pdd-wire config`` as a starting point for the systemd unit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdd_wire import config as cfgmod
from test_daemon import _good, cli, short_dir, tool, write  # noqa: F401

OPERATOR = (Path(__file__).resolve().parent.parent / "docs" / "operator.md").read_text()


def _env(**kw: str) -> dict:
    return {**os.environ, **kw}


def _tool_env(env: dict, *args: str) -> subprocess.CompletedProcess:
    code = "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30,
                          env=env, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------- directories
def test_check_refuses_the_socket_directory_the_agent_refuses_and_names_listen_engine_socket(short_dir):
    shared = short_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may rename the socket: no sticky bit
    text = _good(short_dir).replace(f'engine_socket = "{short_dir}/A.sock"', f'engine_socket = "{shared}/A.sock"')
    path = write(short_dir, "a.toml", text)
    r = cli("--site", "A", "--config", str(path), "--check")
    assert r.returncode == 2 and "'listen.engine_socket'" in r.stderr and str(shared) in r.stderr, r.stderr
    r = cli("--site", "A", "--config", str(path))  # the agent refuses it too, naming the same key
    assert r.returncode == 1 and "listen.engine_socket" in r.stderr and "tls.auto_dir" not in r.stderr, r.stderr


def test_an_unsafe_xdg_runtime_dir_is_named_by_check_and_at_start(short_dir):
    xdg = short_dir / "xdg"
    xdg.mkdir()
    os.chmod(xdg, 0o777)
    env = _env(XDG_RUNTIME_DIR=str(xdg))
    r = cli("--site", "A", "--check", env=env)
    assert r.returncode == 2 and "'XDG_RUNTIME_DIR'" in r.stderr and str(xdg) in r.stderr, r.stderr
    r = cli("--site", "A", env=env)  # fails before it binds a port
    assert r.returncode == 1 and "XDG_RUNTIME_DIR" in r.stderr and "tls.auto_dir" not in r.stderr, r.stderr


def test_check_run_as_root_accepts_the_services_own_runtime_directory(short_dir):
    """The unit's RuntimeDirectory= leaves /run/pdd-wire owned by the service's user, 0755: a
    --check run as root (the guide's install steps) names who the agent must run as, as a
    warning, rather than refusing a directory that is right for the service. A directory that
    is unsafe for anyone is still refused (above)."""
    run = short_dir / "run"
    run.mkdir(mode=0o755)
    os.chown(run, 65534, 65534)
    text = _good(short_dir).replace(f'engine_socket = "{short_dir}/A.sock"', f'engine_socket = "{run}/A.sock"')
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 0 and "config OK" in r.stdout, r.stderr
    assert "warning" in r.stderr and str(run) in r.stderr and "must run as that user" in r.stderr, r.stderr
    assert r.stderr.count("must run as that user") == 1, r.stderr  # the PKI's parent is that directory too


def test_check_creates_nothing(short_dir):
    new = short_dir / "not-yet"
    text = _good(short_dir).replace(f'engine_socket = "{short_dir}/A.sock"', f'engine_socket = "{new}/A.sock"')
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 0, r.stderr
    assert not new.exists() and not list(short_dir.glob("pdd-wire-pki-*"))


# ---------------------------------------------------------------------------------- values
@pytest.mark.parametrize("change, key, words", [
    ('[tls]\nkey = "/etc/hostname"\n', "tls.key", ["without tls.cert"]),
    ('[tls]\nca = "/etc/hostname"\n', "tls.ca", ["without tls.cert"]),
    ('[timeouts]\nconnect_s = inf\n', "timeouts.connect_s", ["604800"]),
    ('[timeouts]\nengine_read_s = inf\n', "timeouts.engine_read_s", ["604800"]),
    ('[timeouts]\nhandshake_s = 1e9\n', "timeouts.handshake_s", ["604800"]),
    ('[timeouts]\nloop_stall_warn_s = inf\n', "timeouts.loop_stall_warn_s", ["604800"]),
    ('[timeouts]\nloop_stall_warn_s = -1\n', "timeouts.loop_stall_warn_s", [">= 0"]),
    ('[transfer]\nunposted_wait_s = inf\n', "transfer.unposted_wait_s", ["604800"]),
    ('[transfer]\nprefix_query_s = nan\n', "transfer.prefix_query_s", ["604800"]),
    ('[policy.pipeline]\nttft_budget_s = -1\n', "policy.pipeline.ttft_budget_s", [">= 0"]),
    ('[policy.pipeline]\nttft_budget_s = 1e9\n', "policy.pipeline.ttft_budget_s", ["604800"]),
    ('[policy.handoff]\nbusy_load = -0.1\n', "policy.handoff.busy_load", [">= 0"]),
    ('[policy.handoff]\nmax_catchup_rounds = 0\n', "policy.handoff.max_catchup_rounds", [">= 1"]),
    ('[limits]\nmax_tokens_per_frame = 1000000000\n', "limits.max_tokens_per_frame", ["1048576"]),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v else None)
def test_a_value_out_of_range_exits_2_naming_its_full_key(short_dir, change, key, words):
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", _good(short_dir) + change)), "--check")
    assert r.returncode == 2 and f"config key '{key}':" in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def _row(key: str) -> str:
    m = re.search(rf"^\| `{re.escape(key)}` \|.*$", OPERATOR, re.M)
    assert m, f"{key} is not in the configuration reference"
    return m.group(0)


# Each range the code enforces (a value just outside it, refused) and the words of the reference
# table that state it.
RANGES = [
    ("transfer", "credit_bytes = 65536", "transfer.credit_bytes", "2^48"),
    ("transfer", "ucx_chunk_bytes = 1", "transfer.ucx_chunk_bytes", "64 KiB .. 64 MiB"),
    ("transfer", 'ucx_tls = "sm self"', "transfer.ucx_tls", "without whitespace"),
    ("transfer", "max_transfers = 0", "transfer.max_transfers", "more than 0"),
    ("transfer", "unposted_wait_s = inf", "transfer.unposted_wait_s", "604800"),
    ("limits", "max_engines = 0", "limits.max_engines", "more than 0"),
    ("limits", "max_tokens_per_frame = 1048577", "limits.max_tokens_per_frame", "1..1048576"),
    ("limits", "engine_queue_bytes = 0", "limits.engine_queue_bytes", "more than 0"),
    ("timeouts", "connect_s = 0", "timeouts.connect_s", "604800"),
    ("timeouts", "heartbeat_s = 1e6", "timeouts.heartbeat_s", "604800"),
    ("timeouts", "loop_stall_warn_s = 1e6", "timeouts.loop_stall_warn_s", "604800"),
    ("listen", "engine_socket_mode = 0o1777", "listen.engine_socket_mode", "0o777"),
    ("policy.pipeline", "ttft_budget_s = 1e6", "policy.pipeline.ttft_budget_s", "604800"),
    ("policy.pipeline", "anomaly_min_input_tokens = 0", "policy.pipeline.anomaly_min_input_tokens", "at least 1"),
    ("policy.handoff", "busy_load = -1", "policy.handoff.busy_load", "at least 0"),
    ("policy.handoff", "catchup_gap_tokens = -1", "policy.handoff.catchup_gap_tokens", "at least 0"),
    ("policy.handoff", "max_catchup_rounds = 0", "policy.handoff.max_catchup_rounds", "at least 1"),
]


@pytest.mark.parametrize("table, line, key, words", RANGES, ids=[r[2] for r in RANGES])
def test_the_reference_table_states_each_range_the_code_enforces(short_dir, table, line, key, words):
    text = _good(short_dir)
    if table == "listen":
        text = text.replace("[listen]\n", f"[listen]\n{line}\n")
    else:
        text += f"[{table}]\n{line}\n"
    with pytest.raises(cfgmod.ConfigError) as exc:
        cfgmod.loads(text)
    assert exc.value.key == key, exc.value
    assert words in _row(key), _row(key)


# ---------------------------------------------------------------------------------- the tool
def test_config_of_an_unknown_site_says_what_the_tool_takes():
    r = tool("config", "--site", "C")
    assert r.returncode == 2 and "'C' has no embedded default" in r.stderr, r.stderr
    assert "pass --config" not in r.stderr and "pdd-wire config --site A" in r.stderr, r.stderr


def test_status_with_a_site_contradicting_its_config_blames_the_flags(short_dir):
    path = write(short_dir, "a.toml", _good(short_dir))
    r = tool("status", "--config", str(path), "--site", "B")
    assert r.returncode == 2 and "--site B contradicts site = 'A'" in r.stderr, r.stderr
    assert "another agent holds" not in r.stderr


def test_the_guide_shows_probes_options():
    line = next(ln for ln in OPERATOR.splitlines() if ln.startswith("pdd-wire probe "))  # the usage line
    assert "--from" in line and "--admin" in line, line


def test_config_prints_a_starting_point_for_the_unit_not_this_shells_runtime_dir(short_dir):
    r = _tool_env(_env(XDG_RUNTIME_DIR=str(short_dir)), "config", "--site", "A")
    assert r.returncode == 0, r.stderr
    assert 'engine_socket = "/run/pdd-wire/pdd-wire-A.sock"' in r.stdout and str(short_dir) not in r.stdout
    cfg = cfgmod.loads(r.stdout)
    assert cfg.site == "A" and cfg.listen.engine_socket == "/run/pdd-wire/pdd-wire-A.sock"
