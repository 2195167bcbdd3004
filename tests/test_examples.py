"""Every example in examples/ runs against real agents (``pdd-wired`` processes) and says it
succeeded. The vLLM example is in test_examples_vllm.py (it needs the vLLM venv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_daemon import daemons, pair_configs, short_dir, wait_peers_up  # noqa: F401

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_every_example_is_tested():
    tested = {"engine_pair.py", "probe.py", "vllm_pd.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


async def test_engine_pair_and_probe_examples_against_two_agents(daemons, short_dir):
    cfg = pair_configs(short_dir)
    a = daemons(["--site", "A", "--config", str(cfg["A"])], name="A")
    b = daemons(["--site", "B", "--config", str(cfg["B"])], name="B")
    await wait_peers_up(cfg["admin"]["A"], a)
    await wait_peers_up(cfg["admin"]["B"], b)

    r = run_example("engine_pair.py", "--socket-a", str(cfg["sock"]["A"]), "--socket-b", str(cfg["sock"]["B"]))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "every byte and token arrived intact" in r.stdout, r.stdout
    assert "tokens [101, 7592, 2088]" in r.stdout, r.stdout

    r = run_example("probe.py", "--admin", cfg["admin"]["A"], "--socket", str(cfg["sock"]["A"]), "--peer", "B",
                    "--seconds", "1")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.startswith(f"agent A/a1 (pid {a.pid}) at {cfg['admin']['A']}; peers: B/b1 up"), r.stdout
    assert "goodput over 1 stream(s):" in r.stdout and "1 GiB of KV to B now:" in r.stdout, r.stdout


def test_examples_default_to_the_daemons_sockets():
    """Without options the examples use the embedded default's engine sockets and admin address."""
    from pdd_wire.config import default_config, default_engine_socket

    r = run_example("engine_pair.py", "--help")
    assert r.returncode == 0 and "--socket-a" in r.stdout
    text = (EXAMPLES / "engine_pair.py").read_text() + (EXAMPLES / "probe.py").read_text()
    assert "default_engine_socket(" in text and "default_config(" in text
    assert default_config("A").listen.engine_socket == default_engine_socket("A")
