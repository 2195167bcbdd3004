"""One vLLM engine (P, RLD or MD) in its own process, driven by JSON lines on stdin/stdout.

Runs in the vLLM venv (.venv-vllm). Usage::

    python -m pdd_tools.vllm.role_server '{"model": DIR, "socket": "/tmp/x/a1.sock", "role": "producer",
                                          "name": "P", "prefix_caching": false, "cpu": "0"}'

``socket`` null: no connector (a plain engine). Prints ``{"ready": ...}`` once the engine is up,
then answers one request per line: ``{"id", "op", ...}`` -> ``{"id", "ok": true, "result"}`` or
``{"id", "ok": false, "error"}``; the ``rld`` op also prints ``{"id", "progress": position}``
lines while it decodes. vLLM's own output goes to stderr.

Ops (see pdd_tools.vllm.driver): ``generate {prompt, max_tokens, kv}``, ``prefill {rid,
prompt, to, deadline_s}``, ``decode {rid, prompt, n, from_site}``, ``rld {rid, prompt, n, md,
load, step_delay_s}``, ``md {rid, prompt, n, rld}``, ``reset``, ``stats``, ``quit``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # The protocol keeps the real stdout; everything else written to fd 1 goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
                      DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=str(cfg.get("cpu", "nobind")))

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    t0 = time.monotonic()
    from pdd_tools.vllm import driver as pdd

    kv = None
    if cfg.get("socket"):
        kv = pdd.connector_config(cfg["socket"], cfg.get("role", "both"), engine_name=cfg.get("name", "vllm"))
        if cfg.get("failure_policy"):
            kv["kv_load_failure_policy"] = cfg["failure_policy"]
    engine = pdd.Engine(cfg["model"], kv=kv, enable_prefix_caching=bool(cfg.get("prefix_caching", False)))
    agent = pdd.Agent(cfg["socket"], cfg.get("name", "vllm") + "-handoff") if cfg.get("socket") else None

    def stats() -> dict | None:
        from pdd_wire.adapters.vllm_connector import WORKERS

        ws = list(WORKERS)
        return dataclasses.asdict(ws[0].stats) if ws else None

    say({"ready": True, "startup_s": round(time.monotonic() - t0, 2), "pid": os.getpid(), "stats": stats()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        rid, op = req.get("id"), req["op"]
        try:
            if op == "quit":
                say({"id": rid, "ok": True, "result": None})
                break
            elif op == "generate":
                res = dataclasses.asdict(engine.run(req["prompt"], req["max_tokens"], req.get("kv")))
            elif op == "prefill":
                res = dataclasses.asdict(pdd.prefill(engine, req["rid"], req["prompt"], req["to"],
                                                     deadline_s=req.get("deadline_s")))
            elif op == "decode":
                res = dataclasses.asdict(pdd.decode(engine, req["rid"], req["prompt"], req["n"],
                                                    from_site=req.get("from_site"), timeout=req.get("timeout", 60)))
            elif op == "rld":
                if req.get("load") is not None:
                    agent.call("set_load", req["load"])
                every = req.get("progress_every", 1)
                r = pdd.RelayDecode(engine, agent, req["rid"], req["prompt"], req["n"], req["md"],
                                    from_site=req.get("from_site"), step_delay_s=req.get("step_delay_s", 0.0),
                                    on_token=lambda pos: pos % every or say({"id": rid, "progress": pos}))  # noqa: B023
                res = dataclasses.asdict(r.run(req.get("timeout", 120)))
            elif op == "md":
                m = pdd.MainDecode(engine, agent, req["rid"], req["prompt"], req["n"], req["rld"],
                                   from_site=req.get("from_site"))
                res = dataclasses.asdict(m.run(req.get("timeout", 120)))
            elif op == "reset":
                res = engine.reset_prefix_cache()
            elif op == "stats":
                res = stats()
            else:
                raise ValueError(f"unknown op {op!r}")
            say({"id": rid, "ok": True, "result": res})
        except Exception as exc:
            traceback.print_exc()
            say({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    if agent is not None:
        agent.close()
    proto.flush()
    os._exit(0)  # vLLM's engine teardown can take seconds; the test is done with us


if __name__ == "__main__":
    main()
