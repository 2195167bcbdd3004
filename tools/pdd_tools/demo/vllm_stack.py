"""What ``scripts/demo --engine vllm`` runs on, started once for both runs (:class:`Stack`), and
``pdd-wire router`` in front of it, one process per run (:class:`RouterProc`).

* three agents as PDD places them (:mod:`~pdd_tools.demo.layout`: P's ``a1`` and RLD's ``a2`` in
  site A, MD's ``b1`` in site B; two network namespaces as root, loopback otherwise), the KV's
  WAN shaped as the simulated demo shapes it: a tbf on the veth (as root) or the shaper's rate
  (loopback), and the shaper's delay in site A in front of MD's agent;
* three real ``vllm serve`` (:class:`pdd_tools.vllm.serve.VllmServer`, the tiny model) with
  PddWireConnector on those agents' engine sockets: P (kv_producer) and RLD (kv_consumer) on
  core 0, site A's; MD (kv_consumer, prefix caching) on core 1, site B's (every thread of a
  server pinned there once it is up: vLLM's engine loop spins while a request waits for its KV,
  and a site's spinning must not take the other site's core). They run in the root namespace and reach their
  agents by Unix socket, wherever those run;
* a delay relay (the shaper, half the RTT each way, no rate) in front of MD's HTTP port: the
  router lives in site A, so a request to MD and MD's tokens back cross the WAN's RTT too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from ..harness import free_port
from ..vllm.serve import VllmServer, complete, completion_body, connector_config, until_healthy
from . import tiny
from .config import MD_PEER, DemoConfig
from .layout import Layout, Procs, agent_toml, layout_for
from .site import agent_samples, connect_engine, peers_up, samples_of, site_figures

CHUNK = 64 << 10  # the agents' smallest chunk (two of the tiny model's blocks): acks often enough
CREDIT = 1 << 20  # for the link estimate; a few RTTs of the scaled WAN in flight
WARM_WAN_BYTES = 1 << 20  # of the warm-up's KV sent across the WAN (see Stack.warm)


def agent_policy(budget_s: float) -> str:
    return f"""[policy.pipeline]
ttft_budget_s = {budget_s}
anomaly_min_input_tokens = {tiny.ANOMALY_MIN_INPUT}
anomaly_max_output_tokens = {tiny.ANOMALY_MAX_OUTPUT}
"""


async def _shaper(procs: Procs, lay: Layout, site: str | None, name: str, listen: tuple[str, int],
                  target: tuple[str, int], log: Path, *, delay_ms: float, jitter_ms: float,
                  rate_Bps: float | None = None) -> tuple[str, int]:
    """A shaper process (in ``site``'s namespace; None: this one); where it listens."""
    argv = [sys.executable, "-m", "pdd_tools.shaper", "--listen", f"{listen[0]}:{listen[1]}",
            "--target", f"{target[0]}:{target[1]}", "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms),
            "--log-level", "warning", "--queue-mib", "16"]
    if rate_Bps:
        argv += ["--rate-mbit", str(rate_Bps * 8 / 1e6)]
    proc = await procs.spawn(name, lay.exec_argv(site, argv) if site else argv, log, pipes=True)
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    if not line.startswith(b"shaper listening on "):
        raise RuntimeError(f"the {name} shaper did not start: {line!r}; see {log}")
    host, _, port = line.split()[3].decode().rpartition(":")
    return host, int(port)


class Stack:
    """``async with Stack(cfg, logs, sites)``: agents, shapers and the three vLLM servers up (in
    that order), all stopped on the way out whatever happens. ``sites``: the namespaces
    (:class:`pdd_tools.netns.TwoSites`, already up) or None for loopback."""

    def __init__(self, cfg: DemoConfig, logs: Path, sites=None, *, on_step=None) -> None:
        self.cfg, self.logs, self.sites = cfg, logs, sites
        self.sock_dir = tempfile.mkdtemp(prefix="pddv-")
        self.lay = layout_for(cfg, sites is not None, self.sock_dir, sites)
        self.procs = Procs()
        self.servers: dict[str, VllmServer] = {}
        self.md_url = ""  # MD through the delay relay: what the router uses
        self.step = on_step or (lambda what: None)
        self.startup_s: dict[str, float] = {}

    async def __aenter__(self) -> Stack:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _start(self) -> None:
        cfg, lay, logs = self.cfg, self.lay, self.logs
        logs.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        kv_wan = await _shaper(self.procs, lay, "A", "kv-wan", lay.shaper_listen, lay.shaper_target,
                               logs / "shaper-kv.log", delay_ms=cfg.rtt_ms / 2, jitter_ms=cfg.jitter_ms,
                               rate_Bps=lay.shaper_rate_Bps)
        py = sys.executable
        for role in ("MD", "RLD", "P"):
            n = lay.nodes[role]
            path = logs / f"{n.node}.toml"
            path.write_text(agent_toml(lay, role, kv_wan, chunk_bytes=CHUNK, credit_bytes=CREDIT,
                                       policy=agent_policy(cfg.ttft_budget_s)))
            await self.procs.spawn(f"agent-{n.node}", lay.exec_argv(n.site, [
                py, "-m", "pdd_wire", "--site", n.site, "--config", str(path)]), logs / f"agent-{n.node}.log")
        clients = [await connect_engine(n.socket, "demo") for n in lay.nodes.values()]
        try:
            await peers_up(clients)
        finally:
            for c in clients:
                await c.close()
        self.step(f"agents up ({time.monotonic() - t0:.1f} s); starting three vllm serve (P, RLD, MD)")
        s = {r: lay.nodes[r].socket for r in ("P", "RLD", "MD")}
        self.servers = {
            "P": VllmServer("P", logs / "vllm-P.log", cpu="0", pin=True,
                            kv=connector_config("kv_producer", s["P"], lease_s=30.0)),
            "RLD": VllmServer("RLD", logs / "vllm-RLD.log", cpu="0", pin=True, failure_policy="recompute",
                              max_num_seqs=tiny.RLD_MAX_NUM_SEQS,
                              kv=connector_config("kv_consumer", s["RLD"], recv_slack_s=2.0)),
            "MD": VllmServer("MD", logs / "vllm-MD.log", cpu="1", pin=True, prefix_caching=True,
                             failure_policy="recompute",
                             kv_cache_bytes=128 << 20,
                             kv=connector_config("kv_consumer", s["MD"], recv_slack_s=2.0)),
        }

        async def start(v: VllmServer) -> None:
            t = time.monotonic()
            await v.start()
            self.startup_s[v.name] = round(time.monotonic() - t, 1)

        await asyncio.gather(*(start(v) for v in self.servers.values()))
        md = self.servers["MD"]
        host, port = await _shaper(self.procs, lay, None, "md-http", ("127.0.0.1", 0), ("127.0.0.1", md.port),
                                   logs / "shaper-md-http.log", delay_ms=cfg.rtt_ms / 2, jitter_ms=cfg.jitter_ms)
        self.md_url = f"http://{host}:{port}"

    async def stop(self) -> None:
        await asyncio.gather(*(v.stop() for v in self.servers.values()), return_exceptions=True)
        await self.procs.stop_all()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    # ------------------------------------------------------------------ the agents
    def _admin(self, role: str, path: str, body: dict | None = None, timeout: float = 30.0) -> str:
        """GET (or POST ``body`` as JSON to) ``path`` of ``role``'s agent's admin server, from
        inside its namespace."""
        n = self.lay.nodes[role]
        url = f"http://{n.admin[0]}:{n.admin[1]}{path}"
        if not self.lay.ns[n.site]:
            import urllib.request

            req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read().decode()
        code = ("import sys, urllib.request as u; b = sys.argv[2].encode() or None; "
                "r = u.urlopen(u.Request(sys.argv[1], data=b, headers={'Content-Type': 'application/json'}), "
                f"timeout={timeout}); sys.stdout.write(r.read().decode())")
        argv = self.lay.exec_argv(n.site, [sys.executable, "-c", code, url, "" if body is None else json.dumps(body)])
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=timeout + 10).stdout

    def agent_figures(self) -> dict[str, dict]:
        """Each agent's WAN bytes and counters (:func:`pdd_tools.demo.site.site_figures`)."""
        out = {}
        for role, n in self.lay.nodes.items():
            samples = samples_of(self._admin(role, "/metrics")) if self.lay.ns[n.site] else agent_samples(
                f"{n.admin[0]}:{n.admin[1]}")
            out[role] = site_figures(samples, n.site)
        return out

    def link_estimate(self) -> dict:
        """P's agent's live estimate of its WAN path to MD (``/v1/status``: bandwidth, RTT, samples)."""
        st = json.loads(self._admin("P", "/v1/status"))
        peer = next((p for p in st.get("peers", []) if p.get("peer") == MD_PEER or p.get("key") == MD_PEER), None)
        return (peer or {}).get("link") or {}

    # ------------------------------------------------------------------ MD's prefix cache
    async def warm(self, http: aiohttp.ClientSession, prompts: list[list[int]],
                   wan_bytes: int = WARM_WAN_BYTES) -> None:
        """MD's prefix cache, and its agent's inventory of it, made to hold ``prompts`` as a live
        MD's would. The longest, up to ``wan_bytes`` of KV, are prefilled on P and their KV sent to
        MD across the WAN (as when MD served them): the agents' live estimate of the link comes
        from that traffic (the tiny model's transfers are too small for ``pdd-wire probe``, whose
        transfers are 16 MiB). MD computes the others itself."""
        P, md = self.servers["P"].url, self.servers["MD"].url
        longest = sorted(prompts, key=len, reverse=True)
        over, left = [], wan_bytes
        while longest and left > 0:
            over.append(longest.pop(0))
            left -= len(over[-1]) * tiny.KV_BYTES_PER_TOKEN

        async def via_wan(p: list[int]) -> None:
            pre = await complete(http, P, completion_body(p, 1, kv_transfer_params={"do_remote_decode": True,
                                                                                    "send_to": [MD_PEER]}))
            await complete(http, md, completion_body(p, 1, kv_transfer_params=pre["kv_transfer_params"]))

        sem = asyncio.Semaphore(8)

        async def on_md(p: list[int]) -> None:
            async with sem:
                await complete(http, md, completion_body(p, 1))

        await asyncio.gather(*(via_wan(p) for p in over), *(on_md(p) for p in longest))
        # MD's connector reports a finished request's blocks with its next engine step.
        await complete(http, md, completion_body([3], 1))

    async def references(self, http: aiohttp.ClientSession, asks: list[tuple[list[int], int]]) -> list[list[int]]:
        """A single server's greedy tokens for each (prompt, max_tokens): P asked directly, no KV
        transfer."""
        p = self.servers["P"].url
        sem = asyncio.Semaphore(8)

        async def one(prompt: list[int], n: int) -> list[int]:
            async with sem:
                return list((await complete(http, p, completion_body(prompt, n)))["choices"][0]["token_ids"])

        return await asyncio.gather(*(one(pr, n) for pr, n in asks))


def router_toml(stack: Stack, kind: str, port: int) -> str:
    """``pdd-wire router``'s config for a run: plain PD (``pd``: P and MD only, every request P-MD
    without asking) or PDD (``pdd``: RLD too, each request's pipeline asked of P's agent, the
    handoff's mode from RLD's live load and the gap, scaled like the answers)."""
    lay, sv = stack.lay, stack.servers
    P, RLD, MD = (lay.nodes[r] for r in ("P", "RLD", "MD"))
    rld = "" if kind == "pd" else (f'[[pools.RLD]]\nurl = "{sv["RLD"].url}"\nengine_socket = "{RLD.socket}"\n'
                                   f'site = "{RLD.site}"\nnode = "{RLD.node}"\n'
                                   f"max_num_seqs = {tiny.RLD_MAX_NUM_SEQS}\n")
    return f"""# generated by pdd_tools.demo (--engine vllm): the {kind} run
[listen]
address = "127.0.0.1:{port}"

[request]
deadline_s = 120

[[pools.P]]
url = "{sv["P"].url}"
engine_socket = "{P.socket}"
site = "{P.site}"
node = "{P.node}"

{rld}
[[pools.MD]]
url = "{stack.md_url}"
engine_socket = "{MD.socket}"
site = "{MD.site}"
node = "{MD.node}"

[choice]
ask_agent = {"false" if kind == "pd" else "true"}
kv_bytes_per_token = {tiny.KV_BYTES_PER_TOKEN}
block_tokens = {tiny.BLOCK}
prefix_salt = "{tiny.PREFIX_SALT}"
timeout_s = 5

[handoff]
md_ready_s = 30

[handoff.policy]
catchup_gap_tokens = {tiny.CATCHUP_GAP}

[log]
level = "info"
format = "json"
"""


class RouterProc:
    """``pdd-wire router --config FILE`` as a user runs it, for one run; ``async with``: up
    (``/healthz`` answers 200) until the block ends. ``log``: its JSON log lines."""

    def __init__(self, stack: Stack, kind: str, run_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = run_dir / "router.toml"
        self.config.write_text(router_toml(stack, kind, self.port))
        self.log = run_dir / "router.log"
        self.procs = Procs()

    async def __aenter__(self) -> RouterProc:
        argv = [sys.executable, "-c", "import sys; from pdd_wire.cli import tool_main; sys.exit(tool_main())",
                "router", "--config", str(self.config)]
        proc = await self.procs.spawn("router", argv, self.log)
        try:
            await until_healthy(f"{self.url}/healthz", proc, 30,
                                lambda: f"pdd-wire router exited ({proc.returncode}); see {self.log}", 0.1)
            return self
        except BaseException:
            await self.procs.stop_all()
            raise

    async def __aexit__(self, *exc) -> None:
        await self.procs.stop_all()

    async def metrics(self, http: aiohttp.ClientSession) -> list:
        async with http.get(f"{self.url}/metrics") as r:
            return samples_of(await r.text())

    def events(self) -> list[dict]:
        """Its log's events (JSON lines; anything else skipped)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict):
                    out.append(ev)
        return out
