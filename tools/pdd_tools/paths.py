"""Where the tools find what lives in a checkout, not in the package: the KV samples
(``tests/data``) and the vLLM venv (``.venv-vllm``).

Installed, a module's ``__file__`` says nothing about the checkout, so nothing here counts
parent directories from it blindly: an environment variable names the place, else the first
match is taken from the current directory upwards (the scripts run at a checkout's root), then
from this file upwards (an editable install in a checkout).
"""

from __future__ import annotations

from pathlib import Path


def find_up(relative: str | Path) -> Path | None:
    """The first ``base / relative`` that exists, ``base`` being the current directory and each
    directory above it, then each directory above this file; None when there is none."""
    cwd = Path.cwd().resolve()
    here = Path(__file__).resolve().parent
    for base in (cwd, *cwd.parents, *here.parents):
        if (base / relative).exists():
            return base / relative
    return None
