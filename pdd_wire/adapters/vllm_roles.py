"""The driving side of ``vllm_role_server.py``: one vLLM engine process per role, in the vLLM venv.

Runs in the main venv (no vllm there); used by tests/test_vllm_adapter.py and by
``scripts/demo --engine vllm`` (:mod:`pdd_wire.adapters.demo`). :func:`venv_paths` finds the vLLM venv and the tiny model
that ``scripts/vllm-env`` builds; :class:`RoleProc` starts a role server and talks JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("vllm_role_server.py")


def venv_paths() -> tuple[Path, Path]:
    """(python, model) of the vLLM venv; ``PDD_VLLM_VENV`` overrides ``.venv-vllm``."""
    venv = Path(os.environ.get("PDD_VLLM_VENV", ROOT / ".venv-vllm"))
    return venv / "bin" / "python", venv / "models" / "tiny-llama"


def missing() -> str | None:
    """Why the vLLM venv cannot be used, or None."""
    py, model = venv_paths()
    if not py.exists():
        return f"{py} is missing"
    if not (model / "model.safetensors").exists():
        return f"the tiny model {model} is missing"
    return None


class RoleProc:
    """One role server. ``cfg``: its JSON config (model, socket, role, name, cpu, ...)."""

    def __init__(self, name: str, cfg: dict, log: Path) -> None:
        self.name, self.log = name, log
        py, model = venv_paths()
        self.cmd = [str(py), str(SERVER), json.dumps({"model": str(model), "name": name, **cfg})]
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict = {}
        self._ids = 0

    async def start(self, timeout: float = 240) -> "RoleProc":
        with open(self.log, "wb") as logf:
            self.proc = await asyncio.create_subprocess_exec(
                *self.cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=logf,
                limit=1 << 24, start_new_session=True)
        self.ready = await self._line(timeout)
        return self

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def _line(self, timeout: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            raise TimeoutError(f"vLLM {self.name}: no answer in {timeout} s; its log ends:\n{self.tail()}") from None
        if not line:
            raise RuntimeError(f"vLLM {self.name} exited ({await self.proc.wait()}); its log ends:\n{self.tail()}")
        return json.loads(line)

    def send(self, op: str, **kw: Any) -> int:
        assert self.proc is not None and self.proc.stdin is not None
        self._ids += 1
        self.proc.stdin.write((json.dumps({"id": self._ids, "op": op, **kw}) + "\n").encode())
        return self._ids

    async def reply(self, rid: int, *, on_progress: Callable[[int], None] | None = None,
                    timeout: float = 120) -> Any:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            msg = await self._line(max(0.1, end - loop.time()))
            if msg.get("id") != rid:
                continue
            if "progress" in msg:
                if on_progress is not None:
                    on_progress(msg["progress"])
                continue
            if not msg["ok"]:
                raise RuntimeError(f"vLLM {self.name}: {msg['error']}; its log ends:\n{self.tail(15)}")
            return msg["result"]

    async def call(self, op: str, *, timeout: float = 120, **kw: Any) -> Any:
        return await self.reply(self.send(op, **kw), timeout=timeout)

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self.send("quit")
            await asyncio.wait_for(self.proc.wait(), 15)
        except (OSError, TimeoutError, ConnectionError):
            self.proc.kill()
            await self.proc.wait()
