"""Peers authenticate by default: the generated deployment PKI (pdd_wire.pki), and what a local
process of another uid can and cannot do against two real agents running on it."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import ssl
import stat

import pytest

from conftest import fill_random, same_bytes
from pdd_wire import config as cfgmod
from pdd_wire import pki
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ConfigError
from pdd_wire.transport.tcp import KIND_BULK, KIND_CONTROL, preamble
from pdd_wire.wire import FrameType, encode_body, encode_bytes
from pdd_wire.wire import messages as m
from support.agents import run_agents, two_site_toml
from support.other_uid import NOBODY, run_as

MiB = 1 << 20


def test_the_embedded_default_authenticates_peers():
    for site in ("A", "B"):
        cfg = cfgmod.default_config(site)
        assert cfg.tls.mode == "auto" and not cfg.tls.allow_plaintext


def _ensure_in_child(d: str, site: str, node: str) -> None:
    pki.ensure(d, site, node)


def test_agents_starting_at_once_share_one_ca_and_keys_are_private(tmp_path):
    d = str(tmp_path / "pki")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ensure_in_child, args=(d, s, n)) for s, n in
             (("A", "a1"), ("B", "b1"), ("A", "a2"), ("B", "b2"))]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(60)
        assert pr.exitcode == 0
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    names = sorted(os.listdir(d))
    assert names == ["A.a1.key", "A.a1.pem", "A.a2.key", "A.a2.pem", "B.b1.key", "B.b1.pem",
                     "B.b2.key", "B.b2.pem", "ca.key", "ca.pem", "lock"]
    for n in names:
        if n.endswith(".key"):
            assert stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) == 0o600
    # Every node certificate verifies against the one CA: a server and a client context agree.
    a, b = pki.ensure(d, "A", "a1"), pki.ensure(d, "B", "b1")
    assert a.created == () and b.created == ()  # already there: nothing regenerated
    from pdd_wire.transport.tls import client_tls_context, server_tls_context

    srv, cli = server_tls_context(b.cert, b.key, b.ca), client_tls_context(a.cert, a.key, a.ca)
    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(ls.getsockname())
    s, _ = ls.accept()
    import threading

    out = {}

    def serve():
        with srv.wrap_socket(s, server_side=True) as t:
            out["peer"] = t.getpeercert()["subject"]
            t.sendall(b"x")

    th = threading.Thread(target=serve)
    th.start()
    with cli.wrap_socket(c, server_hostname="b1") as t:
        assert t.recv(1) == b"x"
    th.join()
    ls.close()
    assert out["peer"] == ((("commonName", "a1"),),)


def test_a_pki_directory_someone_else_can_write_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(ConfigError, match="must be 0700"):
        pki.ensure(str(d), "A", "a1")
    os.chown(d, NOBODY, NOBODY)
    os.chmod(d, 0o700)
    with pytest.raises(ConfigError, match="belongs to uid"):
        pki.ensure(str(d), "A", "a1")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        pki.ensure(str(link), "A", "a1")


def _as_nobody(port: int, attempts: list[tuple[str, bytes]], pki_dir: str) -> dict:
    """In a child process of uid/gid nobody: each attempt connects to ``port``, sends its bytes
    (a preamble and a frame, optionally over TLS without a certificate) and reads the answer.
    Returns {name: what came back} and whether the generated keys were readable."""

    def attempt_all() -> bytes:
        res: dict = {}
        try:
            os.listdir(pki_dir)
            res["pki_readable"] = True
        except OSError:
            res["pki_readable"] = False
        for name, data in attempts:
            got = b""
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if name.startswith("tls"):
                    s.sendall(data[:8])
                    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                    ctx.check_hostname = False
                    ctx.verify_mode = ssl.CERT_NONE
                    s = ctx.wrap_socket(s, server_hostname="b1")
                    data = data[8:]
                s.sendall(data)
                while len(got) < 4096:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            except (OSError, ssl.SSLError):
                pass
            res[name] = got
        return repr(res).encode()

    import ast

    return ast.literal_eval(run_as(NOBODY, attempt_all).decode())


async def test_another_uid_cannot_pose_as_a_peer_and_the_live_session_is_untouched(tmp_sock_dir, engines):
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        sess = ag["B"].sessions["A/a1"]
        control, token = sess.control, sess.token
        hello = encode_bytes(FrameType.HELLO, encode_body(m.Hello(
            versions=[1], site="A", node="a1", incarnation=12345, capabilities=["kv.v1"])))
        bulk = encode_bytes(FrameType.BULK_HELLO, encode_body(m.BulkHello(session=1, stream=0, site="A", node="a1")))
        attempts = [("plain_hello", preamble(KIND_CONTROL) + hello),
                    ("tls_hello", preamble(KIND_CONTROL) + hello),
                    ("plain_bulk", preamble(KIND_BULK) + bulk)]
        pki_dir = pki.default_dir(str(tmp_sock_dir / "B.sock"))
        res = await asyncio.to_thread(_as_nobody, ag["B"].wan_address[1], attempts, pki_dir)
        assert res["pki_readable"] is False
        for name, _ in attempts:
            # No WELCOME (nor BULK_WELCOME): a frame in plaintext would start with the magic.
            assert not res[name].startswith(b"PDDW\x01\x02") and not res[name].startswith(b"PDDW\x01\x07"), name
        assert res["plain_bulk"].startswith(b"PDDW\x01\x03")  # ERROR UNKNOWN_SESSION, then closed
        # The real session was never replaced, and it still carries a transfer.
        assert sess.control is control and sess.token == token and sess.is_up
        ea = await engines.connect(tmp_sock_dir / "A.sock", "prefill")
        eb = await engines.connect(tmp_sock_dir / "B.sock", "decode")
        src, dst = engines.memory(8 * MiB), engines.memory(8 * MiB)
        await fill_random(src)
        ra = await ea.register(src, block_bytes=MiB)
        rb = await eb.register(dst, block_bytes=MiB)
        await eb.post_recv("r", [rb.blocks(0, 8)])
        await ea.send_kv("r", [ra.blocks(0, 8)], to=["B"])
        assert isinstance(await eb.wait("r", timeout=30), p.KvReceived)
        assert await same_bytes(dst.buf, src.buf)
        assert sess.control is control


async def test_agents_of_one_deployment_run_mutual_tls_without_any_tls_config(tmp_sock_dir):
    async with run_agents(two_site_toml(tmp_sock_dir)) as ag:
        for a, other in (("A", "B/b1"), ("B", "A/a1")):
            ssl_obj = ag[a].sessions[other].control.transport.get_extra_info("ssl_object")
            assert ssl_obj is not None and ssl_obj.version() == "TLSv1.3"
        assert ag["B"].sessions["A/a1"].control.peer_names == {"a1"}
        # Bulk connections are bound to that session by its secret token instead (no TLS:
        # proto/handshake.md section 5 has the goodput figures).
        links = ag["A"].sessions["B/b1"].links
        assert links and all(lk.conn.transport.get_extra_info("ssl_object") is None for lk in links.values())


async def test_an_agent_refuses_to_start_on_a_pki_directory_others_can_write(tmp_sock_dir):
    from pdd_wire.agent import Agent

    d = tmp_sock_dir / "shared-pki"
    d.mkdir()
    os.chmod(d, 0o777)
    toml = two_site_toml(tmp_sock_dir, extra=f'[tls]\nauto_dir = "{d}"\n')["A"]
    agent = Agent(cfgmod.loads(toml))
    with pytest.raises(ConfigError, match="tls.auto_dir"):
        await agent.start()
    await agent.shutdown(0)
    assert os.listdir(d) == []  # nothing written into it
