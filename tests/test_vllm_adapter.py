"""vLLM through pdd-wire, end to end: real vLLM engines (CPU, a tiny random-weight Llama), real
agents, the KV in vLLM's own cache blocks (zero-copy memfd) crossing between them.

Topology (one cluster for the whole module; the vLLM processes start once):

    P   (prefill)       vLLM, kv_producer  -> agent a1 (site A)
    RLD (relay decode)  vLLM, kv_consumer  -> agent a2 (site A; a1 <-> a2 over UCX)
    MD  (main decode)   vLLM, kv_consumer  -> agent b1 (site B; a1 -> b1 over TCP through a
                                              fault-injecting relay, a2 <-> b1 TCP direct)

The vLLM engines run in the separate vLLM venv (``scripts/vllm-env``), each in its own process
(pdd_tools.vllm.role_server); this test runs in the main venv and starts the agents.
Every output is compared with the greedy output of a single vLLM instance (P's engine, with no
KV transfer for that request), token id for token id; a cached-token count shows that the
receiving engine used the KV it was sent, and the negative controls show that a wrong KV
changes the output (so the identity check has teeth).
"""

from __future__ import annotations

import array
import asyncio
import math
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio

from conftest import metric
from pdd_tools.shaper import Shaper
from pdd_tools.vllm.roles import RoleProc, missing
from pdd_wire import EngineClient, SharedMemory
from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.engine import protocol as p
from pdd_wire.errors import ErrorCode
from support.agents import cluster_toml, free_port

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.vllm, pytest.mark.ucx]

N = 128  # tokens generated per request
BLOCK = 32  # vLLM block size (tokens) in the role servers
VOCAB = 444


def prompt_for(seed: int, length: int = 75) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


AGENT_EXTRA = """
[transfer]
chunk_bytes = 65536
# The byte-flip test aims at the bulk connection as the one that carries the most: this module's
# KV stays on bulk connections (inline chunks, tests/test_inline.py and the router modules).
inline_bytes = 0
[policy.handoff]
catchup_gap_tokens = 4
"""


class Cluster:
    def __init__(self, tmp: Path, agents: dict[str, Agent], relay: Shaper, P: RoleProc, RLD: RoleProc,
                 MD: RoleProc) -> None:
        self.tmp, self.agents, self.relay = tmp, agents, relay
        self.P, self.RLD, self.MD = P, RLD, MD
        self._base: dict[tuple, list[int]] = {}

    async def baseline(self, prompt: list[int], n: int = N) -> list[int]:
        """A single vLLM instance's greedy output (P's engine; no KV moves for this request)."""
        key = (tuple(prompt), n)
        if key not in self._base:
            res = await self.P.call("generate", prompt=prompt, max_tokens=n, kv=None)
            assert res["num_cached_tokens"] == 0
            self._base[key] = res["tokens"]
        return self._base[key]

    def kv_blocks(self, prompt: list[int]) -> tuple[int, int]:
        """(agent blocks, bytes) of a prompt's KV: every layer's blocks that hold the prompt."""
        st = self.MD.ready["stats"]
        n = math.ceil(len(prompt) / BLOCK) * st["layers"]
        return n, n * st["block_bytes"]


async def _wait_paths(ag: dict[str, Agent]) -> None:
    async with asyncio.timeout(30):
        while not (ag["a1"].sessions["A/a2"].over_ucx and ag["a2"].sessions["A/a1"].over_ucx
                   and all(s.is_up and len(s.links) == s.streams
                           for a in ("a1", "a2") for s in [ag[a].sessions["B/b1"]])):
            await asyncio.sleep(0.02)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    why = missing()
    if why:
        pytest.fail(f"the vLLM venv is needed for this test ({why}): run scripts/vllm-env", pytrace=False)
    tmp = Path(tempfile.mkdtemp(prefix="pdw-vllm-"))
    ports = {n: free_port() for n in ("a1", "a2", "b1")}
    agents: dict[str, Agent] = {}
    procs: list[RoleProc] = []
    async with Shaper(target=("127.0.0.1", ports["b1"])) as relay:
        # a1 dials b1 through the relay (the byte-flip test); a1-a2 is the UCX local path.
        tomls = cluster_toml(tmp, [("A", "a1"), ("A", "a2"), ("B", "b1")], local_transport="ucx", streams=1,
                             extra=AGENT_EXTRA, ports=ports, dial={("a1", "b1"): relay.port})
        try:
            for node in ("a1", "a2", "b1"):
                agents[node] = Agent(cfgmod.loads(tomls[node]))
                await agents[node].start()
            await _wait_paths(agents)
            # Two cores: P and MD share core 0, RLD (decoding while MD catches up) has core 1.
            P = RoleProc("P", {"socket": f"{tmp}/a1.sock", "role": "producer", "cpu": "0"}, tmp / "P.log")
            RLD = RoleProc("RLD", {"socket": f"{tmp}/a2.sock", "role": "consumer", "cpu": "1"}, tmp / "RLD.log")
            MD = RoleProc("MD", {"socket": f"{tmp}/b1.sock", "role": "consumer", "cpu": "0", "prefix_caching": True,
                                 "failure_policy": "recompute"}, tmp / "MD.log")
            procs = [P, RLD, MD]
            t0 = asyncio.get_running_loop().time()
            await asyncio.gather(*(pr.start() for pr in procs))
            each = ", ".join(f"{pr.name} {pr.ready['startup_s']} s" for pr in procs)
            print(f"vLLM engines ready in {asyncio.get_running_loop().time() - t0:.1f} s ({each})")
            for pr in procs:
                assert pr.ready["stats"]["zero_copy"], pr.ready
            yield Cluster(tmp, agents, relay, P, RLD, MD)
        finally:
            await asyncio.gather(*(pr.stop() for pr in procs), return_exceptions=True)
            for a in agents.values():
                await a.shutdown(0)
            shutil.rmtree(tmp, ignore_errors=True)  # logs, sockets, the agents' generated PKI


async def test_prefill_to_main_decode_over_tcp_gives_the_single_instance_output(cluster):
    prompt = prompt_for(1)
    base = await cluster.baseline(prompt)
    assert len(set(base)) > 8  # a varied stream: equality below means something
    await cluster.MD.call("reset")
    md = cluster.MD.send("decode", rid="pd-1", prompt=prompt, n=N, from_site="A")
    pre = await cluster.P.call("prefill", rid="pd-1", prompt=prompt, to=["B"])
    out = await cluster.MD.reply(md)
    assert pre["tokens"] == base[:1]
    assert pre["kv_transfer_params"] == {"pdd_request_id": "pd-1", "num_tokens": len(prompt), "send_to": ["B"]}
    assert out["tokens"] == base
    # The whole prompt came from P's KV (vLLM then recomputes only the last prompt token).
    assert out["num_cached_tokens"] == len(prompt)
    _, nbytes = cluster.kv_blocks(prompt)
    assert metric(cluster.agents["b1"], "pddwire_bytes_total", peer="A/a1", lane="bulk", direction="rx") >= nbytes


async def _handoff(cluster: Cluster, rid: str, prompt: list[int], load: float, behind: int = 40):
    """P -> (RLD over UCX, MD over TCP); MD's KV is posted once RLD has ``behind`` tokens out."""
    base = await cluster.baseline(prompt)
    await cluster.MD.call("reset")
    joined = asyncio.Event()
    rld = cluster.RLD.send("rld", rid=rid, prompt=prompt, n=N, md="B", from_site="A", load=load,
                           step_delay_s=0.01, progress_every=1)
    rld_reply = asyncio.create_task(cluster.RLD.reply(
        rld, on_progress=lambda pos: pos + 1 >= behind and joined.set()))
    pre = asyncio.create_task(cluster.P.call("prefill", rid=rid, prompt=prompt, to=["A/a2", "B"]))
    await asyncio.wait_for(joined.wait(), 60)
    md_out = await cluster.MD.call("md", rid=rid, prompt=prompt, n=N, rld="A/a2")
    rld_out = await rld_reply
    await pre
    rld_em = {int(k): v for k, v in rld_out["emitted"].items()}
    md_em = {int(k): v for k, v in md_out["emitted"].items()}
    # What the user sees: RLD's positions, then MD's, each exactly once, in order.
    assert not set(rld_em) & set(md_em)
    commit = md_out["first_position"]
    assert sorted(rld_em) == list(range(commit)) and sorted(md_em) == list(range(commit, N))
    assert [{**rld_em, **md_em}[i] for i in range(N)] == base
    assert behind <= commit < N  # MD took over mid-stream
    # RLD decoded on P's KV (shipped over UCX); MD loaded it too and extended over it.
    assert rld_out["detail"]["num_cached_tokens"] == len(prompt)
    assert rld_out["generated"] == base[:len(rld_out["generated"])]
    d = md_out["detail"]
    assert d["load_cached_tokens"] == len(prompt) and d["load_token"] == base[0]
    assert d["extends"][0]["first"] == 0
    assert d["extends"][0]["cached"] == len(prompt) // BLOCK * BLOCK  # the prompt's full blocks, as shipped
    assert sum(e["count"] for e in d["extends"]) == commit
    assert md_out["done"]["owner"] == rld_out["done"]["owner"] == "MD"
    print(f"{rid}: mode {md_out['done']['mode']}, RLD generated {len(rld_out['generated'])}, commit at {commit}, "
          f"MD extends {d['extends']}, MD load {d['load_s']} s")
    return rld_out, md_out


async def test_relay_decode_hands_over_to_main_decode_one_shot(cluster):
    rld, md = await _handoff(cluster, "ho-oneshot", prompt_for(2), load=0.95)
    assert md["done"]["mode"] == "one-shot" and rld["done"]["reason"] == "one_shot"
    # RLD commits at MD's first progress report: MD's first extend absorbs everything it held, and
    # at most one more absorbs what RLD generated while that extend ran (one token in a loaded run:
    # a 14 ms extend against RLD's 10 ms steps), never a catch-up's chain of them.
    extends = md["detail"]["extends"]
    assert 1 <= len(extends) <= 2, extends
    assert metric(cluster.agents["a2"], "pddwire_handoff_modes_total", mode="one-shot", reason="rld_busy") >= 1


async def test_relay_decode_hands_over_to_main_decode_catch_up(cluster):
    rld, md = await _handoff(cluster, "ho-catchup", prompt_for(3), load=0.1)
    assert md["done"]["mode"] == "catch-up"
    assert rld["done"]["reason"] in ("catch_up_converged", "catch_up_forced")
    assert metric(cluster.agents["a2"], "pddwire_handoff_modes_total", mode="catch-up", reason="rld_headroom") >= 1


async def test_corrupted_kv_chunk_is_caught_by_the_checksum_and_resent(cluster):
    prompt = prompt_for(4, 100)
    base = await cluster.baseline(prompt)
    await cluster.MD.call("reset")
    b1, a1 = cluster.agents["b1"], cluster.agents["a1"]
    fails0 = metric(b1, "pddwire_checksum_failures_total", peer="A/a1")
    resent0 = metric(a1, "pddwire_retransmits_total", peer="B/b1", reason="checksum")
    # a1 -> b1 runs through the relay: one control and one bulk connection. Aim at a byte well
    # past what any connection has carried, inside the next KV chunk's payload (the bulk
    # connection is the one that gets there: the control connection carries ~1 KB/s).
    far = max(c.bytes_c2s for c in cluster.relay.connections) + 30_000
    cluster.relay.flip_byte_at(far, direction="c2s", min_conn_bytes=far)
    md = cluster.MD.send("decode", rid="flip-1", prompt=prompt, n=N, from_site="A")
    await cluster.P.call("prefill", rid="flip-1", prompt=prompt, to=["B"])
    out = await cluster.MD.reply(md)
    assert cluster.relay.flips_done == 1
    assert metric(b1, "pddwire_checksum_failures_total", peer="A/a1") == fails0 + 1
    assert metric(a1, "pddwire_retransmits_total", peer="B/b1", reason="checksum") == resent0 + 1
    assert out["tokens"] == base and out["num_cached_tokens"] == len(prompt)


async def _fake_prefill(cluster: Cluster, rid: str, n_blocks: int, payload: bytes) -> None:
    """Send ``n_blocks`` agent blocks of ``payload`` for ``rid`` from a1, as a prefill engine would."""
    bb = cluster.MD.ready["stats"]["block_bytes"]
    async with EngineClient(f"{cluster.tmp}/a1.sock", "fake-prefill") as eng:
        with SharedMemory(n_blocks * bb) as mem:
            mem.buf[:] = payload[:n_blocks * bb]
            region = await eng.register(mem, block_bytes=bb)
            await eng.send_kv(rid, [region.blocks(0, n_blocks)], to=["B"])
            ev = await eng.wait(rid, timeout=30)
            assert isinstance(ev, (p.KvSent, p.TransferFailed))
            if isinstance(ev, p.TransferFailed):
                assert ev.code == ErrorCode.SIZE_MISMATCH, ev


async def test_decoding_from_garbage_kv_diverges(cluster):
    """Negative control: the right amount of KV, but noise (fp32 ~ N(0, 1), the engines' dtype;
    raw random bytes would be NaNs and denormals): vLLM uses it, and the output differs."""
    prompt = prompt_for(5)
    base = await cluster.baseline(prompt)
    await cluster.MD.call("reset")
    n_blocks, nbytes = cluster.kv_blocks(prompt)
    md = cluster.MD.send("decode", rid="garbage-1", prompt=prompt, n=N, from_site="A")
    rng = random.Random(7)
    noise = array.array("f", (rng.gauss(0.0, 1.0) for _ in range(nbytes // 4))).tobytes()
    await _fake_prefill(cluster, "garbage-1", n_blocks, noise)
    out = await cluster.MD.reply(md)
    assert out["num_cached_tokens"] == len(prompt)  # loaded, as in the tests above ...
    diff = [i for i in range(N) if out["tokens"][i] != base[i]]
    assert len(diff) > N // 2, diff  # ... and the output is another one


async def test_failed_kv_transfer_reaches_vllm_as_block_load_errors(cluster):
    """A transfer that fails (here: one block short, SIZE_MISMATCH) is reported to vLLM through
    get_block_ids_with_load_errors; with kv_load_failure_policy=recompute vLLM recomputes the
    prompt instead of decoding from the posted blocks, so the output is still the baseline."""
    prompt = prompt_for(6)
    base = await cluster.baseline(prompt)
    await cluster.MD.call("reset")
    before = await cluster.MD.call("stats")
    n_blocks, nbytes = cluster.kv_blocks(prompt)
    md = cluster.MD.send("decode", rid="fail-1", prompt=prompt, n=N, from_site="A")
    await _fake_prefill(cluster, "fail-1", n_blocks - 1, random.Random(8).randbytes(nbytes))
    out = await cluster.MD.reply(md)
    after = await cluster.MD.call("stats")
    assert after["load_failures"] == before["load_failures"] + 1
    assert after["load_error_blocks"] - before["load_error_blocks"] == math.ceil(len(prompt) / BLOCK)
    assert out["tokens"] == base


async def test_older_form_says_when_nothing_was_sent_and_decode_does_not_wait_for_it(cluster):
    """The older parameter form on in-process engines: a prefill that sends nothing (a bad
    field, or no destination) answers with ``pdd_error`` beside the older fields, and a decode
    given that answer computes the prompt at once instead of waiting the agent's post_ttl_s for
    KV that never comes."""
    prompt = prompt_for(7)
    base = await cluster.baseline(prompt)
    bad = await cluster.P.call("generate", prompt=prompt, max_tokens=1,
                               kv={"pdd_request_id": "old-bad-1", "send_to": ["B"], "lease_s": "abc"})
    kv = bad["kv_transfer_params"]
    assert kv["pdd_request_id"] == "old-bad-1" and kv["num_tokens"] == len(prompt)
    assert kv["pdd_error"] == "kv_transfer_params: lease_s must be a number of seconds, got 'abc'"
    none = await cluster.P.call("generate", prompt=prompt, max_tokens=1, kv={"pdd_request_id": "old-bad-2",
                                                                             "send_to": []})
    assert none["kv_transfer_params"]["pdd_error"].startswith("no destinations"), none
    for params in (kv, none["kv_transfer_params"]):
        await cluster.MD.call("reset")  # its prefix cache: the second would hit the first's blocks
        out = await asyncio.wait_for(cluster.MD.call("generate", prompt=prompt, max_tokens=N, kv=params), 60)
        assert out["tokens"] == base and out["num_cached_tokens"] == 0  # computed, nothing loaded
