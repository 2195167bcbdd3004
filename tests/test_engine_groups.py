"""Engines under another user, by the recipes docs/operator.md gives: ``listen.engine_gid`` gives
the engine socket that group (a non-root agent must be a member, else it does not start, naming
the key), and admits a process whose primary *or supplementary* group it is (``SO_PEERGROUPS``,
also past 64 groups); ``listen.engine_uid`` with ``engine_socket_mode = 0o666`` admits that uid and
no other; a mode that cannot let them in is warned of at start and by ``--check``.

Real agents, and engines as forked children that drop to other uids and groups (the suite runs
as root: marker `root`).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket

import pytest

from pdd_wire.engine import protocol as p
from support.agents import free_port, run_agents, two_site_toml
from support.other_uid import NOBODY, run_as
from test_daemon import cli, short_dir, write  # noqa: F401

pytestmark = pytest.mark.root  # runs processes as other uids and groups

GROUP = 4242  # the engines' group


def _connect_as(path: str, uid: int, gid: int, groups: list[int]) -> str:
    """Connect to the engine socket from a child with these credentials: "served" (the agent
    answered its hello), "closed" (the agent closed it) or the connect error's errno name."""
    def connect() -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(path)
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, "error").encode()
        try:
            # The agent may close a refused engine before its hello is written: EPIPE/ECONNRESET.
            s.sendall(p.encode(p.Hello(id=1, engine="probe")))
            data = s.recv(4096)
        except OSError:
            data = b""
        return b"served" if len(data) > 4 else b"closed"

    return run_as(uid, connect, gid=gid, groups=groups).decode()


def _toml(d, listen: str) -> dict:
    tomls = two_site_toml(d)
    tomls["A"] = tomls["A"].replace("engine_socket = ", f"{listen}\nengine_socket = ")
    return tomls


async def test_the_group_recipe_admits_a_supplementary_member_and_no_one_else(tmp_sock_dir):
    os.chmod(tmp_sock_dir, 0o755)
    tomls = _toml(tmp_sock_dir, f"engine_gid = {GROUP}\nengine_socket_mode = 0o660")
    async with run_agents(tomls, sites=("A",), wait_up=False):
        path = str(tmp_sock_dir / "A.sock")
        st = os.stat(path)
        assert (st.st_gid, st.st_mode & 0o777) == (GROUP, 0o660)
        connect = asyncio.to_thread
        # The engine's user is in the group as a supplementary one (SupplementaryGroups=, usermod -aG).
        assert await connect(_connect_as, path, NOBODY, NOBODY, [GROUP]) == "served"
        # ... among more than 64 groups: the agent's first SO_PEERGROUPS buffer is too small (ERANGE).
        many = list(range(20000, 20100)) + [GROUP]
        assert await connect(_connect_as, path, NOBODY, NOBODY, many) == "served"
        # As its primary group.
        assert await connect(_connect_as, path, NOBODY, GROUP, []) == "served"
        # Not in the group: the file mode keeps it out.
        assert await connect(_connect_as, path, NOBODY, NOBODY, [4343]) == "EACCES"


async def test_the_uid_recipe_admits_that_uid_only(tmp_sock_dir):
    os.chmod(tmp_sock_dir, 0o755)
    tomls = _toml(tmp_sock_dir, f"engine_uid = {NOBODY}\nengine_socket_mode = 0o666")
    async with run_agents(tomls, sites=("A",), wait_up=False):
        path = str(tmp_sock_dir / "A.sock")
        assert await asyncio.to_thread(_connect_as, path, NOBODY, NOBODY, []) == "served"
        # Anyone may open the socket now: the agent's uid check is the gate.
        assert await asyncio.to_thread(_connect_as, path, NOBODY - 1, NOBODY - 1, []) == "closed"


def _start_as(sock: str, groups: list[int]) -> str:
    """Start the engine server (engine_gid = GROUP, mode 0o660) in a child running as NOBODY with
    these supplementary groups: "uid gid mode" of the socket it made, or the start's error.
    (The agent's entry point cannot run as NOBODY here: the interpreter lies under /root.)"""
    from pdd_wire.engine_server import EngineServer

    async def start() -> str:
        async def nothing(*args):
            return None

        server = EngineServer(sock, 0o660, handler=nothing, on_gone=nothing, max_engines=4, max_message=1 << 20,
                              allowed_uids={NOBODY}, allowed_gids={GROUP}, socket_gid=GROUP)
        try:
            await server.start()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        st = os.stat(sock)
        await server.close()
        return f"{st.st_uid} {st.st_gid} {st.st_mode & 0o777:o}"

    return run_as(NOBODY, lambda: asyncio.run(start()).encode(), groups=groups).decode()


def _nobodys_dir(short_dir):
    d = short_dir / "run"
    d.mkdir(mode=0o755)
    os.chown(d, NOBODY, NOBODY)
    os.chmod(short_dir, 0o755)
    return d


def test_an_agent_outside_the_group_does_not_start_and_names_listen_engine_gid(short_dir):
    d = _nobodys_dir(short_dir)
    got = _start_as(str(d / "A.sock"), [])
    assert got.startswith("ConfigError") and "listen.engine_gid" in got and f"group {GROUP}" in got, got
    assert not (d / "A.sock").exists()


def test_an_agent_in_the_group_gives_its_socket_that_group(short_dir):
    d = _nobodys_dir(short_dir)
    assert _start_as(str(d / "A.sock"), [GROUP]) == f"{NOBODY} {GROUP} 660"


@pytest.mark.parametrize("listen, warned, fix", [
    (f"engine_uid = {NOBODY}", f"listen.engine_uid {NOBODY} cannot connect", "0o666"),
    (f"engine_gid = {GROUP}", f"listen.engine_gid {GROUP} cannot connect", "0o660"),
    (f"engine_uid = {NOBODY}\nengine_socket_mode = 0o666", None, None),
    (f"engine_gid = {GROUP}\nengine_socket_mode = 0o660", None, None),
], ids=["uid-0600", "gid-0600", "uid-0666", "gid-0660"])
def test_check_warns_of_a_mode_the_configured_engines_cannot_pass(short_dir, listen, warned, fix):
    os.chmod(short_dir, 0o755)
    text = (f'site = "A"\nnode = "a1"\n[listen]\nwan = "127.0.0.1:{free_port()}"\nadmin = ""\n'
            f'engine_socket = "{short_dir}/A.sock"\n{listen}\n')
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 0 and "config OK" in r.stdout, r.stderr
    if warned:
        assert "warning" in r.stderr and warned in r.stderr and fix in r.stderr, r.stderr
    else:
        assert "warning" not in r.stderr, r.stderr


def test_check_warns_of_a_socket_directory_no_other_user_can_search(short_dir):
    os.chmod(short_dir, 0o700)
    text = (f'site = "A"\nnode = "a1"\n[listen]\nwan = "127.0.0.1:{free_port()}"\nadmin = ""\n'
            f'engine_socket = "{short_dir}/A.sock"\nengine_gid = {GROUP}\nengine_socket_mode = 0o660\n')
    r = cli("--site", "A", "--config", str(write(short_dir, "a.toml", text)), "--check")
    assert r.returncode == 0 and f"{short_dir} (mode 0700) lets no other user reach" in r.stderr, r.stderr
