"""``pdd-wired`` as a real process: configuration errors, the embedded default, sd_notify,
SIGTERM with transfers in flight, JSON logs, and ``pdd-wire config``.

Every agent here is a ``sys.executable -m pdd_wire`` subprocess; the test process plays the
engines (EngineClient) and, where a link must stall, the network (a pdd_tools.shaper.Shaper it can pause).
Readiness is always awaited (an sd_notify datagram, /v1/status), never slept for.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest

from conftest import fill_random, same_bytes
from pdd_tools.shaper import Shaper
from pdd_wire import config as cfgmod
from pdd_wire.engine import protocol as p
from pdd_wire.errors import EngineRequestError, ErrorCode
from support.agents import free_port

MiB = 1 << 20


# ---------------------------------------------------------------------------------- helpers
def cli(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """``pdd-wired ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "pdd_wire", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def tool(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """``pdd-wire ARGS`` (the operator tool's entry point) to completion."""
    code = "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def short_dir():
    """A directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="pdw-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Daemon:
    """One ``pdd-wired`` subprocess; stdout and stderr go to ``log`` (a file, not a terminal)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.args = args
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdd_wire", *args], stdout=f, stderr=f,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float = 20) -> int:
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pdd-wired {self.args} did not exit within {timeout}s:\n{self.text()}") from None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL (the whole process group) if it does not go."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def daemons(short_dir):
    started: list[Daemon] = []

    def start(args: list[str], *, name: str, env: dict | None = None) -> Daemon:
        d = Daemon(args, short_dir / f"{name}.log", env)
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            d.stop()
        # Shown by pytest only when the test failed: every agent's own account (one that died
        # or never came up is otherwise invisible behind a timeout of the one being waited on).
        for d in started:
            print(f"---- pdd-wired {' '.join(d.args)} (exit {d.proc.returncode}):\n{d.text()[-6000:]}")


def http_get(url: str, timeout: float = 2) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def get(url: str) -> tuple[int, bytes]:
    # Off the loop: the loop may be running a relay that must keep forwarding meanwhile.
    return await asyncio.to_thread(http_get, url)


async def wait_peers_up(admin: str, daemon: Daemon, timeout: float = 20) -> dict:
    """Poll /v1/status until every peer is up with all its bulk connections; the status."""
    async with asyncio.timeout(timeout):
        while True:
            if not daemon.alive():
                raise AssertionError(f"pdd-wired exited with {daemon.proc.returncode}:\n{daemon.text()}")
            try:
                code, body = await get(f"http://{admin}/v1/status")
            except OSError:
                code = 0
            if code == 200:
                st = json.loads(body)
                if st["peers"] and all(x["up"] and x["bulk_streams_up"] == x["bulk_streams"] for x in st["peers"]):
                    return st
            await asyncio.sleep(0.05)


def pair_configs(d: Path, *, wan: dict | None = None, a_dials: int | None = None, extra: str = "") -> dict:
    """Config files for sites A (a1) and B (b1) on loopback (``wan`` ports, default free ones);
    A dials B at ``a_dials`` (default: B's WAN port; a relay's port to put one in between)."""
    wan = wan or {"A": free_port(), "B": free_port()}
    admin = {"A": free_port(), "B": free_port()}
    out = {"wan": wan, "admin": {s: f"127.0.0.1:{admin[s]}" for s in "AB"},
           "sock": {s: d / f"{s}.sock" for s in "AB"}}
    for site, node, other, onode in (("A", "a1", "B", "b1"), ("B", "b1", "A", "a1")):
        port = a_dials if (site == "A" and a_dials) else wan[other]
        text = f"""site = "{site}"
node = "{node}"
[listen]
wan = "127.0.0.1:{wan[site]}"
admin = "127.0.0.1:{admin[site]}"
engine_socket = "{d}/{site}.sock"
[[peers]]
site = "{other}"
node = "{onode}"
address = "127.0.0.1:{port}"
streams = 2
[transfer]
chunk_bytes = 1048576
streams = 2
{extra}
"""
        path = d / f"{site}.toml"
        path.write_text(text)
        out[site] = path
    return out


def write(d: Path, name: str, text: str) -> Path:
    path = d / name
    path.write_text(text)
    return path


GOOD = """site = "A"
node = "a1"
[listen]
wan = "127.0.0.1:{wan}"
admin = ""
engine_socket = "{dir}/A.sock"
[[peers]]
site = "B"
node = "b1"
address = "127.0.0.1:{peer}"
"""


# ---------------------------------------------------------------------------------- bad configs
def _good(d: Path) -> str:
    return GOOD.format(wan=free_port(), peer=free_port(), dir=d)


def test_good_config_checks_ok(short_dir):
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", _good(short_dir))), "--check")
    assert r.returncode == 0, r.stderr
    assert "config OK" in r.stdout and "node a1" in r.stdout


@pytest.mark.parametrize("change, key, words", [
    ('[transfer]\nbogus = 1\n', "transfer.bogus", ["unknown field"]),
    ('[transfer]\nchunk_bytes = "x"\n', "transfer.chunk_bytes", ["int", "str"]),
    ('[transfer]\nstreams = 0\n', "transfer.streams", ["1..64", "0"]),
    ('[transfer]\nchunk_bytes = 1\n', "transfer.chunk_bytes", ["64 KiB"]),
    ('[timeouts]\nshutdown_grace_s = -1\n', "timeouts.shutdown_grace_s", ["> 0"]),
    ('[log]\nlevel = "loud"\n', "log.level", []),
], ids=["unknown-key", "wrong-type", "streams-0", "chunk-1", "negative-grace", "bad-enum"])
def test_bad_value_exits_2_naming_the_key(short_dir, change, key, words):
    path = write(short_dir, "a.toml", _good(short_dir) + change)
    r = cli("--site", "A", "--config", str(path), "--check")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"'{key}'" in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_missing_required_key_exits_2_naming_it(short_dir):
    text = _good(short_dir).replace('node = "a1"\n', "", 1)
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2 and "'node'" in r.stderr and "missing" in r.stderr, r.stderr


def test_missing_required_key_in_a_table_exits_2_naming_it(short_dir):
    text = _good(short_dir).replace('address = "127.0.0.1:', 'addr_typo = "127.0.0.1:')
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2, r.stderr
    assert "peers" in r.stderr and ("address" in r.stderr or "addr_typo" in r.stderr), r.stderr


def test_non_loopback_plaintext_exits_2_naming_listen_wan_and_the_way_out(short_dir):
    text = _good(short_dir).replace('wan = "127.0.0.1:', 'wan = "10.1.2.3:7000" #', 1)
    assert 'wan = "10.1.2.3:7000"' in text
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2, r.stderr
    assert "'listen.wan'" in r.stderr and "tls.allow_plaintext" in r.stderr and "10.1.2.3:7000" in r.stderr
    # The same file with the explicit opt-in passes the check.
    ok = write(short_dir, "b.toml", text + "[tls]\nallow_plaintext = true\n")
    r = cli("--site", "A", "--config", str(ok), "--check")
    assert r.returncode == 0, r.stderr


def test_non_loopback_peer_without_tls_names_the_peer_address(short_dir):
    text = _good(short_dir).replace('address = "127.0.0.1:', 'address = "192.0.2.7:7601" #', 1)
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2 and "'peers[0].address'" in r.stderr and "tls.allow_plaintext" in r.stderr, r.stderr


def test_tls_cert_file_missing_exits_2_naming_tls_cert(short_dir):
    ca = write(short_dir, "ca.pem", "not used: the cert is checked first\n")
    text = _good(short_dir) + f'[tls]\ncert = "{short_dir}/nope.pem"\nkey = "{short_dir}/nope.key"\nca = "{ca}"\n'
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2 and "'tls.cert'" in r.stderr and "nope.pem" in r.stderr, r.stderr


def test_tls_cert_without_key_exits_2_naming_tls_key(short_dir):
    cert = write(short_dir, "c.pem", "x\n")
    text = _good(short_dir) + f'[tls]\ncert = "{cert}"\nca = "{cert}"\n'
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2 and "'tls.key'" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from support.certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), ["a1", "b1"])


@pytest.mark.parametrize("case, key, words", [
    ("key-of-another-node", "tls.key", ["is not the key of the certificate"]),
    ("cert-not-pem", "tls.cert", ["is not a PEM certificate"]),
    ("cert-of-another-ca", "tls.cert", ["is not signed by tls.ca"]),
    ("ca-is-a-leaf", "tls.ca", ["no root CA certificate"]),
], ids=["key-of-another-node", "cert-not-pem", "cert-of-another-ca", "ca-is-a-leaf"])
def test_tls_files_tls_would_refuse_exit_2_naming_the_key_check_and_start(short_dir, certs, case, key, words):
    """What TLS would refuse at start (or peers in every handshake) is a configuration error named
    by its key, found by --check and at start alike: exit 2, which the systemd unit does not restart."""
    cert, keyfile, ca = certs["a1"][0], certs["a1"][1], certs["ca"]
    if case == "key-of-another-node":
        keyfile = certs["b1"][1]
    elif case == "cert-not-pem":
        cert = write(short_dir, "c.pem", "not a certificate\n")
    elif case == "cert-of-another-ca":
        cert, keyfile = certs["rogue"]
    else:
        ca = certs["b1"][0]
    text = _good(short_dir) + f'[tls]\ncert = "{cert}"\nkey = "{keyfile}"\nca = "{ca}"\n'
    path = str(write(short_dir, "a.toml", text))
    for extra in (["--check"], []):
        r = cli("--site", "A", "--config", path, *extra)
        assert r.returncode == 2, (extra, r.returncode, r.stderr)
        assert f"'{key}'" in r.stderr and all(w in r.stderr for w in words), r.stderr
    good = _good(short_dir) + f'[tls]\ncert = "{certs["a1"][0]}"\nkey = "{certs["a1"][1]}"\nca = "{certs["ca"]}"\n'
    r = cli("--site", "A", "--config", str(write(short_dir, "b.toml", good)), "--check")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("change, key", [
    ('[listen]\nengine_socket_mode = 0\n', "listen.engine_socket_mode"),
    ('[listen]\nengine_uid = -1\n', "listen.engine_uid"),
    ('[timeouts]\nloop_stall_warn_s = -1\n', "timeouts.loop_stall_warn_s"),
], ids=["socket-mode-0", "uid-negative", "stall-negative"])
def test_values_that_cannot_work_exit_2(short_dir, change, key):
    text = _good(short_dir)
    if change.startswith("[listen]"):  # the file has a [listen] table already: add to it
        text = text.replace("[listen]\n", change, 1)
    else:
        text += change
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 2 and f"'{key}'" in r.stderr, r.stderr


def test_loop_stall_warn_0_is_a_valid_config(short_dir):
    text = _good(short_dir) + "[timeouts]\nloop_stall_warn_s = 0\n"
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 0, r.stderr


def test_invalid_toml_exits_2(short_dir):
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", 'site = "A\nnode = [\n')), "--check")
    assert r.returncode == 2 and "not valid TOML" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_unreadable_config_file_exits_2_naming_the_path(short_dir, what):
    path = short_dir / "absent.toml" if what == "missing" else short_dir
    r = cli("--site", "A", "--config", str(path), "--check")
    assert r.returncode == 2 and "cannot read" in r.stderr and str(path) in r.stderr, r.stderr


def test_unknown_site_without_config_exits_2_naming_the_site():
    r = cli("--site", "Z", "--check")
    assert r.returncode == 2, r.stderr
    assert "'site'" in r.stderr and "'Z'" in r.stderr and "--config" in r.stderr, r.stderr


def test_usage_error_exits_2():
    r = cli("--config", "/nonexistent.toml")  # --site is required
    assert r.returncode == 2 and "--site" in r.stderr


def test_bad_config_without_check_exits_2_before_binding_anything(short_dir):
    """The daemon proper (no --check) refuses a bad file the same way and binds nothing."""
    wan = free_port()
    text = GOOD.format(wan=wan, peer=free_port(), dir=short_dir) + "[transfer]\nstreams = 0\n"
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), timeout=30)
    assert r.returncode == 2 and "'transfer.streams'" in r.stderr, r.stderr
    assert not (short_dir / "A.sock").exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", wan))  # still free


def test_unknown_site_without_check_exits_2():
    r = cli("--site", "Z")
    assert r.returncode == 2 and "'Z'" in r.stderr


def test_overrides_from_the_command_line_are_validated_too(short_dir):
    path = write(short_dir, "a.toml", _good(short_dir))
    r = cli("--site", "A", "--config", str(path), "--node", "bad/name", "--check")
    assert r.returncode == 2 and "'node'" in r.stderr, r.stderr
    r = cli("--site", "A", "--config", str(path), "--node", "a7", "--check")
    assert r.returncode == 0 and "node a7" in r.stdout, r.stderr


def test_pdd_wire_config_prints_toml_the_daemon_accepts(short_dir):
    for site in ("A", "B"):
        r = tool("config", "--site", site)
        assert r.returncode == 0, r.stderr
        assert f'site = "{site}"' in r.stdout
        path = write(short_dir, f"{site}.toml", r.stdout)
        chk = cli("--site", site, "--config", str(path), "--check")
        assert chk.returncode == 0, chk.stderr
        assert f"site {site}" in chk.stdout and "1 peers" in chk.stdout
        # It is the embedded default, with the engine socket where the systemd unit puts it.
        default = cfgmod.default_config(site)
        listen = msgspec.structs.replace(default.listen, engine_socket=f"/run/pdd-wire/pdd-wire-{site}.sock")
        assert cfgmod.load(path) == msgspec.structs.replace(default, listen=listen)
    r = tool("config", "--site", "Z")
    assert r.returncode == 2 and "'Z'" in r.stderr


# ---------------------------------------------------------------------------------- running
def _child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "XDG_RUNTIME_DIR")}
    env.update(extra)
    return env


async def test_embedded_default_sites_find_each_other(daemons, short_dir, engines):
    """``pdd-wired --site A`` and ``--site B`` with no config: loopback ports 7601/7602 (WAN) and
    7701/7702 (admin), engine sockets under $XDG_RUNTIME_DIR."""
    env = _child_env(XDG_RUNTIME_DIR=str(short_dir))
    a = daemons(["--site", "A"], name="A", env=env)
    b = daemons(["--site", "B"], name="B", env=env)
    st = await wait_peers_up("127.0.0.1:7701", a)
    assert st["site"] == "A" and st["node"] == "a1" and st["wan"] == "127.0.0.1:7601"
    assert st["engine_socket"] == str(short_dir / "pdd-wire-A.sock")
    assert [x["peer"] for x in st["peers"]] == ["B/b1"] and st["peers"][0]["role"] == "dialer"
    stb = await wait_peers_up("127.0.0.1:7702", b)
    assert [x["peer"] for x in stb["peers"]] == ["A/a1"] and stb["peers"][0]["role"] == "listener"

    code, body = await get("http://127.0.0.1:7701/healthz")
    assert code == 200 and json.loads(body) == {"ok": True}
    code, body = await get("http://127.0.0.1:7701/readyz")
    assert code == 200 and json.loads(body) == {"ready": True, "listening": True, "peers_up": 1, "peers": 1,
                                                "all_peers_up": True}
    code, body = await get("http://127.0.0.1:7701/metrics")
    assert code == 200
    assert 'pddwire_peer_up{peer="B/b1"} 1.0' in body.decode().splitlines()
    code, body = await get("http://127.0.0.1:7702/metrics")
    assert 'pddwire_peer_up{peer="A/a1"} 1.0' in body.decode().splitlines()

    # The engine socket is where the default says, and it answers as site A.
    eng = await engines.connect(short_dir / "pdd-wire-A.sock", "probe")
    assert eng.agent["site"] == "A" and eng.agent["peers"] == ["B/b1"]

    a.terminate()
    b.terminate()
    assert await a.wait() == 0, a.text()
    assert await b.wait() == 0, b.text()
    assert not (short_dir / "pdd-wire-A.sock").exists()  # removed on the way out


async def test_sd_notify_ready_after_listeners_and_stopping_on_sigterm(daemons, short_dir):
    notify_path = str(short_dir / "notify")
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        recv.bind(notify_path)
        recv.setblocking(False)
        loop = asyncio.get_running_loop()
        wan, admin = free_port(), free_port()
        text = GOOD.format(wan=wan, peer=free_port(), dir=short_dir).replace('admin = ""',
                                                                             f'admin = "127.0.0.1:{admin}"')
        cfg = write(short_dir, "a.toml", text)
        d = daemons(["--site", "A", "--config", str(cfg)], name="A", env=_child_env(NOTIFY_SOCKET=notify_path))

        async with asyncio.timeout(20):
            msg = await loop.sock_recv(recv, 4096)
        lines = msg.decode().split("\n")
        assert lines[0] == "READY=1", msg
        assert any(line.startswith("STATUS=") for line in lines[1:]), msg

        # READY=1 means every listener is bound: each answers at once, no retry.
        eng = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            eng.connect(str(short_dir / "A.sock"))
        finally:
            eng.close()
        code, body = await get(f"http://127.0.0.1:{admin}/readyz")
        assert code == 200 and json.loads(body)["ready"] is True
        with socket.create_connection(("127.0.0.1", wan), timeout=2):
            pass

        d.terminate()
        async with asyncio.timeout(20):
            msg = await loop.sock_recv(recv, 4096)
        assert msg == b"STOPPING=1"
        assert await d.wait() == 0, d.text()
    finally:
        recv.close()


async def test_log_is_json_lines_with_bound_fields_when_not_a_terminal(daemons, short_dir):
    cfg = pair_configs(short_dir)  # no [log] section: format "auto"
    a = daemons(["--site", "A", "--config", str(cfg["A"])], name="A")
    b = daemons(["--site", "B", "--config", str(cfg["B"])], name="B")
    await wait_peers_up(cfg["admin"]["A"], a)
    await wait_peers_up(cfg["admin"]["B"], b)
    a.terminate()
    assert await a.wait() == 0
    records = json_lines(a.text())
    assert records
    for r in records:
        assert {"event", "level", "timestamp"} <= r.keys(), r
    events = [r["event"] for r in records]
    assert "agent ready" in events and "stopped" in events
    ready = next(r for r in records if r["event"] == "agent ready")
    assert ready["site"] == "A" and ready["node"] == "a1" and ready["level"] == "info"
    up = [r for r in records if r["event"] == "peer up"]
    assert up and up[0]["peer"] == "B/b1", up
    # SIGINT stops it as cleanly as SIGTERM.
    b.proc.send_signal(signal.SIGINT)
    assert await b.wait() == 0, b.text()
    assert json_lines(b.text())[-1]["event"] == "stopped"


async def wait_ready(admin: str, daemon: Daemon, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while True:
            if not daemon.alive():
                raise AssertionError(f"pdd-wired exited with {daemon.proc.returncode}:\n{daemon.text()}")
            try:
                code, _ = await get(f"http://{admin}/readyz")
            except OSError:
                code = 0
            if code == 200:
                return
            await asyncio.sleep(0.05)


def json_lines(text: str) -> list[dict]:
    """Every non-empty line parsed as one JSON object (fails on anything else, e.g. a traceback)."""
    out = []
    for ln in text.splitlines():
        if ln.strip():
            try:
                out.append(json.loads(ln))
            except ValueError:
                raise AssertionError(f"not a JSON log line: {ln!r}\n--- whole output:\n{text}") from None
    return out


async def test_wan_port_in_use_exits_1_with_an_error_line(daemons, short_dir):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        text = GOOD.format(wan=port, peer=free_port(), dir=short_dir)
        d = daemons(["--site", "A", "--config", str(write(short_dir, "a.toml", text))], name="A")
        assert await d.wait() == 1, d.text()
    records = json_lines(d.text())
    err = [r for r in records if r["event"] == "cannot start"]
    assert err and err[0]["level"] == "error" and "in use" in err[0]["error"], records
    assert not (short_dir / "A.sock").exists()


async def test_engine_socket_in_use_exits_1_with_an_error_line_and_spares_the_live_agent(daemons, short_dir):
    """A second agent configured with a live agent's engine socket must not steal it; it fails
    to start like any other start-up failure: exit 1 and a "cannot start" log line."""
    first_admin = f"127.0.0.1:{free_port()}"
    text = GOOD.format(wan=free_port(), peer=free_port(), dir=short_dir)
    text = text.replace('admin = ""', f'admin = "{first_admin}"')
    first = daemons(["--site", "A", "--config", str(write(short_dir, "a.toml", text))], name="A")
    await wait_ready(first_admin, first)
    text2 = GOOD.format(wan=free_port(), peer=free_port(), dir=short_dir)  # same engine socket
    second = daemons(["--site", "A", "--config", str(write(short_dir, "a2.toml", text2))], name="A2")
    assert await second.wait() == 1, second.text()
    # The first agent still owns its socket.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(short_dir / "A.sock"))
    assert first.alive()
    records = json_lines(second.text())
    err = [r for r in records if r["event"] == "cannot start"]
    assert err and err[0]["level"] == "error" and str(short_dir / "A.sock") in err[0]["error"], records


# ---------------------------------------------------------------------------------- SIGTERM
async def _relayed_pair(daemons, d: Path, relay: Shaper, wan: dict, extra: str):
    """A dials B through ``relay`` (which forwards to ``wan["B"]``); both up."""
    cfg = pair_configs(d, wan=wan, a_dials=relay.port, extra=extra)
    b = daemons(["--site", "B", "--config", str(cfg["B"])], name="B")
    a = daemons(["--site", "A", "--config", str(cfg["A"])], name="A")
    await wait_peers_up(cfg["admin"]["A"], a)
    await wait_peers_up(cfg["admin"]["B"], b)
    return cfg, a, b


async def test_sigterm_fails_a_stuck_transfer_with_shutting_down_after_the_grace(daemons, short_dir, engines):
    extra = "[timeouts]\nshutdown_grace_s = 1\nheartbeat_s = 1\ndead_after_s = 30\n"
    wan = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", wan["B"])) as relay:
        cfg, a, b = await _relayed_pair(daemons, short_dir, relay, wan, extra)
        ea = await engines.connect(cfg["sock"]["A"], "prefill")
        src = engines.memory(8 * MiB)
        await fill_random(src)
        ra = await ea.register(src, block_bytes=MiB)

        relay.pause()  # nothing gets through: the transfer cannot finish
        sends = await ea.send_kv("stuck", [ra.blocks(0, 8)], to=["B"])
        assert sends[0]["to"] == "B/b1"

        a.terminate()
        first = await ea.wait_for(lambda e: isinstance(e, (p.Shutdown, p.TransferFailed)), timeout=20)
        assert isinstance(first, p.Shutdown), first  # engines are told before anything is cancelled
        assert first.grace_s == 1.0

        # During the grace period new work is refused.
        with pytest.raises(EngineRequestError) as ei:
            await ea.send_kv("late", [ra.blocks(0, 1)], to=["B"])
        assert ei.value.code == ErrorCode.SHUTTING_DOWN

        ev = await ea.wait("stuck", timeout=20)
        assert isinstance(ev, p.TransferFailed), ev
        assert ev.code == ErrorCode.SHUTTING_DOWN and ev.direction == "out" and ev.peer == "B/b1"
        assert ev.transfer_id == sends[0]["transfer_id"]
        assert await a.wait() == 0, a.text()
        assert b.alive()


async def test_sigterm_lets_a_transfer_that_can_finish_complete_before_exit(daemons, short_dir, engines):
    extra = "[timeouts]\nshutdown_grace_s = 15\nheartbeat_s = 1\ndead_after_s = 30\n"
    wan = {"A": free_port(), "B": free_port()}
    async with Shaper(target=("127.0.0.1", wan["B"])) as relay:
        cfg, a, b = await _relayed_pair(daemons, short_dir, relay, wan, extra)
        ea = await engines.connect(cfg["sock"]["A"], "prefill")
        eb = await engines.connect(cfg["sock"]["B"], "decode")
        src, dst = engines.memory(16 * MiB), engines.memory(16 * MiB)
        await fill_random(src)
        ra = await ea.register(src, block_bytes=MiB)
        rb = await eb.register(dst, block_bytes=MiB)
        await eb.post_recv("drain", [rb.blocks(0, 16)], from_site="A")

        relay.pause()
        await ea.send_kv("drain", [ra.blocks(0, 16)], to=["B"])
        a.terminate()
        ev = await ea.wait_for(lambda e: isinstance(e, (p.Shutdown, p.TransferFailed, p.KvSent)), timeout=20)
        assert isinstance(ev, p.Shutdown) and ev.grace_s == 15.0, ev
        # New sends are refused while the open one drains.
        with pytest.raises(EngineRequestError) as ei:
            await ea.send_kv("late", [ra.blocks(0, 1)], to=["B"])
        assert ei.value.code == ErrorCode.SHUTTING_DOWN

        # Draining: not ready, and no longer accepting engines or peers.
        code, body = await get(f"http://{cfg['admin']['A']}/readyz")
        assert code == 503 and json.loads(body)["ready"] is False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(OSError):
            s.connect(str(cfg["sock"]["A"]))
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", cfg["wan"]["A"]), timeout=2).close()

        relay.resume()  # the link heals within the grace period
        sent = await ea.wait("drain", timeout=30)
        assert isinstance(sent, p.KvSent) and sent.bytes == 16 * MiB, sent
        got = await eb.wait("drain", timeout=30)
        assert isinstance(got, p.KvReceived) and got.bytes == 16 * MiB, got
        assert await same_bytes(dst.buf, src.buf)
        assert await a.wait(timeout=30) == 0, a.text()
        # Nothing was left to cancel when it stopped.
        events = [json.loads(ln)["event"] for ln in a.text().splitlines() if ln.strip()]
        assert "shutting down" in events and "stopped" in events
        assert "grace period over; cancelling transfers" not in events
        assert b.alive()
