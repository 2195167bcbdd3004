"""The driving side of :mod:`pdd_tools.vllm.role_server`: one vLLM engine process per role, in
the vLLM venv.

Runs in the main venv (no vllm there); used by tests/test_vllm_adapter.py and by
``scripts/demo --engine vllm`` (:mod:`pdd_tools.vllm.demo`). :func:`venv_paths` finds the vLLM
venv and the tiny model that ``scripts/vllm-env`` builds; :class:`RoleProc` starts a role server
and talks JSON lines.

The vLLM venv is ``$PDD_VLLM_VENV`` when set; otherwise the first ``.venv-vllm`` found in the
current directory or one above it (a checkout's root, where ``scripts/vllm-env`` builds it), then
above this file (an editable install in a checkout). The role servers import ``pdd_tools`` and
``pdd_wire`` from that venv: ``scripts/vllm-env`` installs both there.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pdd_wire

from .. import __file__ as _tools_init
from ..paths import find_up

VENV_ENV = "PDD_VLLM_VENV"
VENV_DIR = ".venv-vllm"
MODEL_DIR = Path("models") / "tiny-llama"  # inside the venv
SERVER_MODULE = "pdd_tools.vllm.role_server"


def find_venv() -> Path | None:
    """The vLLM venv: ``$PDD_VLLM_VENV``, else the nearest ``.venv-vllm`` (see the module doc)."""
    if os.environ.get(VENV_ENV):
        return Path(os.environ[VENV_ENV])
    py = find_up(Path(VENV_DIR) / "bin" / "python")
    return None if py is None else py.parents[1]


def checkout_path() -> str:
    """``PYTHONPATH`` for processes in the vLLM venv: the directories this process imports
    ``pdd_wire`` and ``pdd_tools`` from, first. The venv holds editable installs of one checkout;
    another checkout (a git worktree) sharing that venv then still runs its own code."""
    dirs = [str(Path(pdd_wire.__file__).resolve().parents[1]), str(Path(_tools_init).resolve().parents[1])]
    return os.pathsep.join(dict.fromkeys(dirs))


def venv_paths() -> tuple[Path, Path]:
    """(python, model) of the vLLM venv; RuntimeError, naming ``PDD_VLLM_VENV``, when none is found."""
    venv = find_venv()
    if venv is None:
        raise RuntimeError(missing())
    return venv / "bin" / "python", venv / MODEL_DIR


def missing() -> str | None:
    """Why the vLLM venv cannot be used, or None."""
    venv = find_venv()
    if venv is None:
        return (f"no {VENV_DIR} in {Path.cwd()} or above it; build one with scripts/vllm-env or set "
                f"{VENV_ENV} to the vLLM venv")
    py, model = venv / "bin" / "python", venv / MODEL_DIR
    if not py.exists():
        return f"{py} is missing ({VENV_ENV}={os.environ.get(VENV_ENV, '')!r}); build it with scripts/vllm-env"
    if not (model / "model.safetensors").exists():
        return f"the tiny model {model} is missing; build it with scripts/vllm-env"
    return None


class RoleProc:
    """One role server. ``cfg``: its JSON config (model, socket, role, name, cpu, ...)."""

    def __init__(self, name: str, cfg: dict, log: Path) -> None:
        self.name, self.log = name, log
        py, model = venv_paths()
        self.cmd = [str(py), "-m", SERVER_MODULE, json.dumps({"model": str(model), "name": name, **cfg})]
        self.env = {**os.environ, "PYTHONPATH": checkout_path()}
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict = {}
        self._ids = 0

    async def start(self, timeout: float = 240) -> "RoleProc":
        with open(self.log, "wb") as logf:
            self.proc = await asyncio.create_subprocess_exec(
                *self.cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=logf,
                env=self.env, limit=1 << 24, start_new_session=True)
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
