"""examples/vllm_pd.py, run as a user runs it: with the vLLM venv's Python (``scripts/vllm-env``
builds it; ``scripts/test`` does when it is missing), this checkout first on the path. It starts
two agents and a prefill and a decode vLLM engine, and must print identical tokens with the
prompt's KV loaded over the wire. About a minute."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.vllm
def test_vllm_pd_example():
    venv = Path(os.environ.get("PDD_VLLM_VENV", ROOT / ".venv-vllm"))
    python, model = venv / "bin" / "python", venv / "models" / "tiny-llama"
    if not (python.exists() and (model / "model.safetensors").exists()):
        pytest.fail(f"the vLLM venv is needed for this test ({venv} or its model is missing): run scripts/vllm-env",
                    pytrace=False)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([str(python), str(ROOT / "examples" / "vllm_pd.py"), "--model", str(model)],
                       capture_output=True, text=True, timeout=400, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout, r.stderr[-4000:])
    assert "identical, and the KV came from prefill" in r.stdout, r.stdout
    assert "96 prompt tokens over the wire" in r.stdout, r.stdout
