"""A router over one P and one MD member that asks no agent (``ask_agent = false``: every
request P-MD), for the router tests that need no agents."""

from __future__ import annotations

from pdd_wire.router import Router, loads


def p_md_router(p: str, md: str, *, port: int = 0, **request: float) -> Router:
    """P at ``p``, MD at ``md`` (URLs), listening on 127.0.0.1:``port``; ``request``: keys of its
    ``[request]`` table (``deadline_s = 10``, ...)."""
    keys = "".join(f"{k} = {v}\n" for k, v in request.items())
    return Router(loads(f"""
[listen]
address = "127.0.0.1:{port}"
[request]
{keys}
[[pools.P]]
url = "{p}"
site = "A"
[[pools.MD]]
url = "{md}"
site = "B"
[choice]
ask_agent = false
"""))
