"""``scripts/demo --engine vllm --side-by-side``: the PD and PDD flows with three tiny vLLM
instances, token by token (the trace through ``pdd-wire router`` is :mod:`pdd_tools.demo.vllm_runner`).

Three agents on loopback as PDD places them -- prefill ``a1`` and relay decode ``a2`` in site A
(UCX between them), main decode ``b1`` in site B (TCP) -- and one vLLM engine per role
(:mod:`pdd_tools.vllm.role_server`, in the vLLM venv that ``scripts/vllm-env``
builds). For a few prompts it prints the generated token ids side by side: a single vLLM
instance (the reference), plain PD (MD decodes from P's KV) and PDD (RLD decodes from P's KV
over UCX while MD's copy crosses over TCP, then hands the output over). Both must equal the
reference, position for position.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from pathlib import Path

N = 64  # tokens per request
VOCAB = 444  # the tiny model's


def _prompt(seed: int, length: int = 75) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def _row(label: str, tokens: list[int], base: list[int], mark: int | None = None, width: int = 20) -> str:
    shown = [f"{t:>3}" for t in tokens[:width]]
    if mark is not None and mark < width:
        shown.insert(mark, "|")
    first = next((i for i, (a, b) in enumerate(zip(tokens, base)) if a != b), min(len(tokens), len(base)))
    same = "identical" if tokens == base else f"DIFFERS at {first}"
    return f"  {label:<9} {' '.join(shown)} ...  {same}"


async def _run(requests: int) -> int:
    from pdd_wire import config as cfgmod
    from pdd_wire import log
    from pdd_wire.agent import Agent

    from ..harness import agent_toml, free_port
    from .roles import RoleProc, missing

    log.configure("warning", "console")  # the agents run in this process: keep the table readable
    why = missing()
    if why:
        print(f"pdd-tools demo --engine vllm: the vLLM venv is needed ({why}): run scripts/vllm-env")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="pdw-vllm-demo-"))
    nodes = {"a1": "A", "a2": "A", "b1": "B"}
    ports = {n: (free_port(), free_port()) for n in nodes}
    agents: dict[str, Agent] = {}
    procs: list[RoleProc] = []
    try:
        for node, site in nodes.items():
            peers = [(s, n, ports[n][0]) for n, s in nodes.items() if n != node]
            text = agent_toml(site, node, ports[node][0], ports[node][1], str(tmp / f"{node}.sock"), peers,
                              streams=1, chunk=64 << 10, local_transport="ucx",
                              extra="[policy.handoff]\ncatchup_gap_tokens = 4\n")
            agents[node] = Agent(cfgmod.loads(text))
            await agents[node].start()
        async with asyncio.timeout(30):
            while not (agents["a1"].sessions["A/a2"].is_up and agents["a2"].sessions["A/a1"].is_up
                       and all(agents[a].sessions["B/b1"].is_up for a in ("a1", "a2"))):
                await asyncio.sleep(0.05)
        paths = {k: s.describe()["data_path"] for k, s in agents["a1"].sessions.items()}
        print(f"agents up: a1 -> a2 over {paths['A/a2']}, a1 -> b1 over {paths['B/b1']}; starting three vLLM engines")
        P = RoleProc("P", {"socket": f"{tmp}/a1.sock", "role": "producer", "cpu": "0"}, tmp / "P.log")
        RLD = RoleProc("RLD", {"socket": f"{tmp}/a2.sock", "role": "consumer", "cpu": "1"}, tmp / "RLD.log")
        MD = RoleProc("MD", {"socket": f"{tmp}/b1.sock", "role": "consumer", "cpu": "0", "prefix_caching": True},
                      tmp / "MD.log")
        procs = [P, RLD, MD]
        await asyncio.gather(*(pr.start() for pr in procs))
        print("vLLM engines ready (" + ", ".join(f"{pr.name} {pr.ready['startup_s']} s" for pr in procs) + ")\n")
        ok = True
        for i in range(requests):
            prompt = _prompt(100 + i)
            base = (await P.call("generate", prompt=prompt, max_tokens=N, kv=None))["tokens"]
            # Plain cross-DC PD: MD waits for P's KV, then decodes everything.
            await MD.call("reset")
            md_req = MD.send("decode", rid=f"pd-{i}", prompt=prompt, n=N, from_site="A")
            await P.call("prefill", rid=f"pd-{i}", prompt=prompt, to=["B"])
            pd = await MD.reply(md_req)
            # PDD: P -> (RLD over UCX, MD over TCP); RLD decodes, MD joins 24 tokens in, handoff.
            await MD.call("reset")
            load = 0.95 if i % 2 == 0 else 0.1  # busy RLD: one-shot; headroom: catch-up
            joined = asyncio.Event()
            rld_req = RLD.send("rld", rid=f"pdd-{i}", prompt=prompt, n=N, md="B", from_site="A", load=load,
                               step_delay_s=0.01, progress_every=1)
            rld_task = asyncio.ensure_future(RLD.reply(rld_req,
                                                       on_progress=lambda pos, j=joined: pos >= 23 and j.set()))
            pre = asyncio.ensure_future(P.call("prefill", rid=f"pdd-{i}", prompt=prompt, to=["A/a2", "B"]))
            await asyncio.wait_for(joined.wait(), 60)
            md = await MD.call("md", rid=f"pdd-{i}", prompt=prompt, n=N, rld="A/a2")
            rld = await rld_task
            await pre
            emitted = {int(k): v for k, v in rld["emitted"].items()} | {int(k): v for k, v in md["emitted"].items()}
            pdd = [emitted.get(j, -1) for j in range(N)]
            p = md["first_position"]
            print(f"request {i}: {len(prompt)} prompt tokens, {N} generated; handoff {md['done']['mode']}, "
                  f"commit at position {p} (RLD emitted 0..{p - 1}, MD {p}..{N - 1})")
            print(_row("vLLM", base, base))
            print(_row("PD", pd["tokens"], base))
            print(_row("PDD", pdd, base, mark=p))
            print()
            ok &= pd["tokens"] == base and pdd == base
        print("PD and PDD give the single instance's tokens" if ok else "MISMATCH: see above")
        return 0 if ok else 1
    finally:
        await asyncio.gather(*(pr.stop() for pr in procs), return_exceptions=True)
        for a in agents.values():
            await a.shutdown(0)
        shutil.rmtree(tmp, ignore_errors=True)


def run_demo(args) -> int:
    return asyncio.run(_run(3))
