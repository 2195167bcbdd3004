"""The engine socket's directory and the generated PKI's are refused when another local user owns
or can write them (pdd_wire.rundir): else they could rename the engine socket and bind their own
(and be handed the engines' KV memfds), or swap the CA and keys."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pdd_wire import config as cfgmod
from pdd_wire import pki, rundir
from pdd_wire.agent import Agent
from pdd_wire.engine_server import EngineServer
from pdd_wire.errors import ConfigError
from support.agents import free_port
from support.other_uid import NOBODY


def _default_agent(monkeypatch, tmp, *, xdg: bool) -> tuple[Agent, Path]:
    """``pdd-wired --site A`` without a config, its runtime directory in ``tmp``: the private
    fallback (``/tmp/pdd-wire-<uid>``, its ``/tmp`` moved to ``tmp``), or ``$XDG_RUNTIME_DIR``."""
    if xdg:
        run = tmp / "xdg"
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    else:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setattr(rundir, "TMP_DIR", str(tmp))
        run = tmp / f"pdd-wire-{os.getuid()}"
    toml = cfgmod.default_toml("A").replace("7601", str(free_port())).replace("7701", str(free_port()))
    cfg = cfgmod.loads(toml)
    assert os.path.dirname(cfg.listen.engine_socket) == str(run)
    return Agent(cfg), run


async def _refused(agent: Agent, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        await agent.start()
    await agent.shutdown(0)
    return str(info.value)


def test_the_default_without_xdg_runtime_dir_is_per_uid_in_tmp(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert cfgmod.default_engine_socket("A") == f"/tmp/pdd-wire-{os.getuid()}/pdd-wire-A.sock"


@pytest.mark.parametrize("xdg", [False, True], ids=["fallback", "xdg"])
async def test_the_default_directory_is_created_0700_and_the_agent_serves_engines(monkeypatch, tmp_sock_dir,
                                                                                    engines, xdg):
    agent, run = _default_agent(monkeypatch, tmp_sock_dir, xdg=xdg)
    await agent.start()
    try:
        st = os.lstat(run)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        eng = await engines.connect(run / "pdd-wire-A.sock", "probe")
        assert eng.agent["site"] == "A"
        assert sorted(os.listdir(run)) == ["pdd-wire-A.sock", f"pdd-wire-pki-{os.geteuid()}"]
    finally:
        await agent.shutdown(0)


@pytest.mark.parametrize("xdg", [False, True], ids=["fallback", "xdg"])
async def test_a_default_directory_squatted_by_another_uid_is_refused(monkeypatch, tmp_sock_dir, xdg):
    agent, run = _default_agent(monkeypatch, tmp_sock_dir, xdg=xdg)
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    msg = await _refused(agent, "belongs to uid 65534")
    assert repr(str(run)) in msg and "mode 0700" in msg and "Refusing to start" in msg
    assert ("remove it" in msg) == (not xdg)
    assert os.listdir(run) == []  # no socket bound, no key generated in it


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o750])
async def test_the_private_fallback_others_can_enter_is_refused(monkeypatch, tmp_sock_dir, mode):
    # /tmp/pdd-wire-<uid> is private: even sticky, even group read-only, it is not ours alone.
    agent, run = _default_agent(monkeypatch, tmp_sock_dir, xdg=False)
    run.mkdir()
    os.chmod(run, mode)
    msg = await _refused(agent, f"mode 0{mode:03o}")
    assert f"must be owned by uid {os.geteuid()} with mode 0700" in msg
    assert os.listdir(run) == []


async def test_an_xdg_runtime_dir_may_be_searchable_but_not_writable_by_others(monkeypatch, tmp_sock_dir,
                                                                               engines):
    # deploy/systemd: XDG_RUNTIME_DIR=/run/pdd-wire, 0755, which engines of other uids traverse.
    agent, run = _default_agent(monkeypatch, tmp_sock_dir, xdg=True)
    run.mkdir()
    os.chmod(run, 0o777)
    await _refused(agent, "not writable by group or others unless sticky")
    assert os.listdir(run) == []
    os.chmod(run, 0o755)
    agent, run = _default_agent(monkeypatch, tmp_sock_dir, xdg=True)
    await agent.start()
    try:
        eng = await engines.connect(run / "pdd-wire-A.sock", "probe")
        assert eng.agent["site"] == "A"
    finally:
        await agent.shutdown(0)


@pytest.mark.parametrize("xdg", [False, True], ids=["fallback", "xdg"])
async def test_a_symlinked_default_directory_is_refused(monkeypatch, tmp_sock_dir, xdg):
    agent, link = _default_agent(monkeypatch, tmp_sock_dir, xdg=xdg)
    real = tmp_sock_dir / "real"
    real.mkdir(mode=0o700)
    link.symlink_to(real)
    msg = await _refused(agent, "is a symlink")
    assert str(real) in msg and os.listdir(real) == []


def test_a_pki_directory_in_a_parent_others_can_write_is_refused(tmp_sock_dir):
    # The reviewer's reproduction: a parent of nobody's, 0777; the keys must not be generated.
    parent = tmp_sock_dir / "shared"
    parent.mkdir()
    os.chown(parent, NOBODY, NOBODY)
    os.chmod(parent, 0o777)
    with pytest.raises(ConfigError, match="tls.auto_dir.*belongs to uid 65534.*mode 0777"):
        pki.ensure(str(parent / "pki"), "A", "a1")
    assert os.listdir(parent) == []
    os.chown(parent, os.geteuid(), os.getegid())  # ours, but writable by all without the sticky bit
    with pytest.raises(ConfigError, match="not writable by group or others unless sticky"):
        pki.ensure(str(parent / "pki"), "A", "a1")
    os.chmod(parent, 0o1777)  # sticky, as /tmp: nobody can rename what is not theirs
    made = pki.ensure(str(parent / "pki"), "A", "a1")
    assert os.path.exists(made.key)


async def _serve(path) -> EngineServer:
    async def handler(conn, msg, fd):
        return None

    async def gone(conn):
        pass

    srv = EngineServer(str(path), 0o660, handler=handler, on_gone=gone, max_engines=4, max_message=1 << 20,
                       allowed_uids={os.geteuid()})
    await srv.start()
    return srv


async def test_a_configured_socket_directory_may_be_shared_with_a_group_but_not_writable(tmp_sock_dir):
    d = tmp_sock_dir / "engines"
    d.mkdir()
    os.chmod(d, 0o750)  # /run/pdd-wire shared with the engines' group
    srv = await _serve(d / "e.sock")
    await srv.close()
    for mode in (0o770, 0o777):
        os.chmod(d, mode)
        with pytest.raises(ConfigError, match=r"listen.engine_socket.*not writable by group or others"):
            await _serve(d / "e.sock")
    os.chmod(d, 0o1777)
    srv = await _serve(d / "e.sock")
    await srv.close()
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        await _serve(d / "e.sock")
    os.chown(d, os.geteuid(), os.getegid())
    os.rename(d, tmp_sock_dir / "elsewhere")
    os.symlink(tmp_sock_dir / "elsewhere", d)
    with pytest.raises(ConfigError, match="is a symlink"):
        await _serve(d / "e.sock")
