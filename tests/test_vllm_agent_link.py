"""The vLLM connector's agent connection (pdd_wire.adapters.agent_link.AgentLink), against a real
agent, without vLLM: when the agent stops, ``current`` is None at once (what the connector's
worker fails its pending receives and sends on); when an agent is back on the socket the link
reconnects and registers the engine's memory again, so an agent restart needs no vLLM restart.
The same with a whole vLLM: tests/test_vllm_serve.py."""

from __future__ import annotations

import asyncio

from pdd_wire import config as cfgmod
from pdd_wire.adapters.agent_link import AgentLink
from pdd_wire.adapters.loop_thread import LoopThread
from pdd_wire.agent import Agent
from pdd_wire.memory import SharedMemory
from support.agents import two_site_toml


async def _until(cond, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def _engines(agent: Agent) -> dict[str, int]:
    """Engine name (without the agent's #n) -> regions it registered."""
    return {e["name"].rpartition("#")[0]: e["regions"] for e in agent.describe()["engines"]}


async def test_the_link_reconnects_and_registers_again_after_an_agent_restart(tmp_sock_dir):
    toml = two_site_toml(tmp_sock_dir)["A"]
    agent = Agent(cfgmod.loads(toml))
    await agent.start()
    lt = LoopThread("test-link")
    mem = SharedMemory(1 << 20)
    setups = []

    async def setup(eng):
        region = await eng.register(mem, block_bytes=4096, name="kv")
        setups.append(region)
        return region

    link = AgentLink(lt, f"{tmp_sock_dir}/A.sock", "worker", setup, first_retry_s=0.05, max_retry_s=0.2)
    watcher = AgentLink(lt, f"{tmp_sock_dir}/A.sock", "scheduler", end_on_shutdown=True,
                        first_retry_s=0.05, max_retry_s=0.2)
    try:
        first = await asyncio.to_thread(link.start)
        await asyncio.to_thread(watcher.start)
        assert first.generation == 1 and first.eng.agent["site"] == "A" and len(setups) == 1
        assert _engines(agent) == {"worker": 1, "scheduler": 0}

        await agent.shutdown(1.0)  # as systemd's stop does: a shutdown event, then the close
        await _until(lambda: link.current is None and watcher.current is None, 2)
        assert watcher.reason == "the agent is shutting down"  # told, before the connection ended
        assert "closed" in link.reason, link.reason
        await asyncio.sleep(0.5)  # retrying meanwhile (every 0.2 s at most): nothing to connect to
        assert link.current is None and len(setups) == 1

        agent = Agent(cfgmod.loads(toml))  # the agent is back on the same socket
        await agent.start()
        await _until(lambda: link.current is not None and watcher.current is not None)
        again = link.current
        assert again.generation == 2 and again.eng is not first.eng and len(setups) == 2
        assert again.state is setups[1]  # the memory, registered with the new agent
        assert _engines(agent) == {"worker": 1, "scheduler": 0}
        await asyncio.to_thread(lambda: lt.run(again.eng.status()))  # and it serves

        await asyncio.to_thread(link.drop, first, "a stale drop")  # an older connection's: ignored
        assert link.current is again
        await asyncio.to_thread(link.drop, again, "the engine gave it up")  # e.g. lost events
        assert link.current is None and link.reason == "the engine gave it up"
        await _until(lambda: link.current is not None)
        assert link.current.generation == 3 and len(setups) == 3 and link.lost == 2
    finally:
        await asyncio.to_thread(link.close)
        await asyncio.to_thread(watcher.close)
        lt.close()
        await agent.shutdown(0)
        mem.close()
