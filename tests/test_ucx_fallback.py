"""Without ucxx, a peer configured transport = "ucx" still gets its KV, over TCP, and the agent
says why once. Real agent processes, with ucxx made unimportable by a sitecustomize."""

import asyncio
import json
import os
import subprocess
import sys
import urllib.request

from conftest import fill_random, same_bytes
from pdd_wire.engine import protocol as p
from support.agents import cluster_toml, free_port

MiB = 1 << 20


def _status(admin: str) -> dict:
    with urllib.request.urlopen(f"http://{admin}/v1/status", timeout=2) as r:
        return json.load(r)


async def test_agents_without_ucxx_fall_back_to_tcp_and_say_so(tmp_sock_dir, tmp_path, engines):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['ucxx'] = None\n")
    tomls = cluster_toml(tmp_sock_dir, [("A", "a1"), ("A", "a2")], local_transport="ucx")
    procs, logs, admins = {}, {}, {}
    env = dict(os.environ, PYTHONPATH=f"{hide}:{os.getcwd()}")
    try:
        for node, text in tomls.items():
            admin_port = free_port()
            text = text.replace('admin = "127.0.0.1:0"', f'admin = "127.0.0.1:{admin_port}"')
            admins[node] = f"127.0.0.1:{admin_port}"
            cfg = tmp_path / f"{node}.toml"
            cfg.write_text(text)
            logs[node] = tmp_path / f"{node}.log"
            with open(logs[node], "wb") as out:
                procs[node] = subprocess.Popen([sys.executable, "-m", "pdd_wire", "--site", "A", "--config", str(cfg)],
                                               stdout=out, stderr=subprocess.STDOUT, env=env)
        async with asyncio.timeout(20):
            while True:
                try:
                    peers = [_status(admins[n])["peers"][0] for n in ("a1", "a2")]
                except OSError:
                    peers = []
                if peers and all(pe["up"] and pe["bulk_streams_up"] == pe["bulk_streams"] for pe in peers):
                    break
                await asyncio.sleep(0.05)
        assert all(pe["data_path"] == "tcp" and pe["transport"] == "ucx" for pe in peers)
        tx = await engines.connect(tmp_sock_dir / "a1.sock", "prefill")
        rx = await engines.connect(tmp_sock_dir / "a2.sock", "rld")
        src, dst = engines.memory(16 * MiB), engines.memory(16 * MiB)
        await fill_random(src)
        rs, rd = await tx.register(src, block_bytes=MiB), await rx.register(dst, block_bytes=MiB)
        await rx.post_recv("r", [rd.blocks(0, 16)])
        await tx.send_kv("r", [rs.blocks(0, 16)], to=["A/a2"])
        assert isinstance(await rx.wait("r", timeout=30), p.KvReceived)
        assert await same_bytes(dst.buf, src.buf)
    finally:
        for pr in procs.values():
            pr.terminate()
        for pr in procs.values():
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()
    for node, path in logs.items():
        said = [json.loads(line) for line in path.read_text().splitlines() if "UCX is unavailable" in line]
        assert len(said) == 1, (node, said)  # once, with the reason
        assert "ucxx is not importable" in said[0]["reason"]
