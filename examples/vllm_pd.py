"""Prefill/decode disaggregation with vLLM and pdd-wire, on one machine: two agents (sites A
and B), a prefill vLLM engine on A that ships a prompt's KV cache through the agents, and a
decode vLLM engine on B that decodes from that KV instead of recomputing it.

Runs with the Python of the vLLM venv (``scripts/vllm-env`` builds it and a tiny local Llama):

    .venv-vllm/bin/python examples/vllm_pd.py [--model DIR] [--tokens N]

It starts everything itself (agents and engines as child processes, in a temporary
directory), prints the decode engine's tokens beside those of the same engine computing the
prompt itself, and exits 0 when they are identical and the prompt's KV came over the wire. The
connector's settings are the ``kv_transfer_config`` below; see docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
PROMPT = [1] + [(7 * i + 3) % 400 + 20 for i in range(95)]  # 96 token ids (3 blocks of 32)


# ---------------------------------------------------------------------------------- an engine
def engine_main(role: str, model: str, sock: str) -> None:
    """A child process: one vLLM engine with PddWireConnector, driven by lines on stdin."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
                      HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = os.fdopen(os.dup(1), "w", buffering=1)  # vLLM's own output goes to stderr
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="PddWireConnector", kv_connector_module_path="pdd_wire.adapters.vllm_connector",
                          kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                          kv_connector_extra_config={"engine_socket": sock})
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=512, seed=0,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, kv_transfer_config=kv)
    engine = llm.llm_engine
    out.write(json.dumps({"ready": role}) + "\n")

    def run(prompt: list[int], max_tokens: int, params: dict | None) -> dict:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        rid = f"r{time.monotonic_ns()}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        done = None
        while engine.has_unfinished_requests():  # a producer keeps its blocks until the KV is sent
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    done = o
            time.sleep(0.002)
        return {"tokens": list(done.outputs[0].token_ids), "cached": done.num_cached_tokens}

    for line in sys.stdin:
        req = json.loads(line)
        out.write(json.dumps(run(req["prompt"], req["max_tokens"], req.get("kv"))) + "\n")


class Engine:
    def __init__(self, role: str, model: str, sock: str, log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115 -- stop() closes it
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--role", role, "--model", model, "--socket", sock],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the engine exited ({self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def ask(self, prompt: list[int], max_tokens: int, kv: dict | None = None) -> None:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "kv": kv}) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self.log.close()


# ---------------------------------------------------------------------------------- the agents
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_configs(d: Path) -> dict:
    wan = {"A": free_port(), "B": free_port()}
    admin = {"A": free_port(), "B": free_port()}
    out = {}
    for site, other in (("A", "B"), ("B", "A")):
        (d / f"{site}.toml").write_text(f"""site = "{site}"
node = "{site.lower()}1"
[listen]
wan = "127.0.0.1:{wan[site]}"
admin = "127.0.0.1:{admin[site]}"
engine_socket = "{d}/{site}.sock"
[[peers]]
site = "{other}"
node = "{other.lower()}1"
address = "127.0.0.1:{wan[other]}"
""")
        out[site] = {"config": d / f"{site}.toml", "admin": f"127.0.0.1:{admin[site]}", "socket": f"{d}/{site}.sock"}
    return out


def wait_peers_up(admin: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"pdd-wired exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{admin}/readyz?peers=all", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the agent at {admin} did not connect to its peer within {timeout} s")


def main(argv: list[str] | None = None) -> int:
    venv = Path(os.environ.get("PDD_VLLM_VENV", HERE.parent.parent / ".venv-vllm"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(venv / "models" / "tiny-llama"), help="a local model directory")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to decode")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        engine_main(args.role, args.model, args.socket)
        return 0

    with tempfile.TemporaryDirectory(prefix="pdd-vllm-") as tmp:
        d = Path(tmp)
        cfg = agent_configs(d)
        agents = {s: subprocess.Popen([sys.executable, "-m", "pdd_wire", "--site", s, "--config", str(c["config"])],
                                      stdout=open(d / f"agent-{s}.log", "wb"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT)
                  for s, c in cfg.items()}
        engines = {}
        try:
            for s in "AB":
                wait_peers_up(cfg[s]["admin"], agents[s])
            print("agents A and B up; starting the prefill and decode vLLM engines ...", flush=True)
            engines = {"P": Engine("prefill", args.model, cfg["A"]["socket"], d / "prefill.log"),
                       "D": Engine("decode", args.model, cfg["B"]["socket"], d / "decode.log")}
            for e in engines.values():
                e.read()
            # The reference: the decode engine computes the prompt itself.
            engines["D"].ask(PROMPT, args.tokens)
            ref = engines["D"].read()
            # P/D: decode posts where the prompt's KV goes and waits; prefill computes it and sends it.
            engines["D"].ask(PROMPT, args.tokens, {"pdd_request_id": "pd-1", "from_site": "A"})
            engines["P"].ask(PROMPT, 1, {"pdd_request_id": "pd-1", "send_to": ["B"]})
            pre, pd = engines["P"].read(), engines["D"].read()
        finally:
            for e in engines.values():
                e.stop()
            for a in agents.values():
                a.terminate()
                a.wait(30)
        print(f"decode computing the prompt itself: {ref['tokens']}")
        print(f"decode from prefill's KV:           {pd['tokens']} ({pd['cached']} prompt tokens over the wire)")
        ok = pd["tokens"] == ref["tokens"] and pd["cached"] > 0 and pre["tokens"][0] == ref["tokens"][0]
        print("identical, and the KV came from prefill" if ok else "MISMATCH")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
