"""What :class:`~pdd_wire.adapters.vllm_connector.PddWireConnector` accepts, checked once where
it enters: its config (``kv_connector_extra_config``, at start-up: a bad key stops vLLM with a
``ValueError`` naming it) and a request's ``kv_transfer_params`` (per request: any HTTP client
writes them, so a bad field never raises into vLLM's scheduler; the request is then not sent, or
not loaded). Imports no engine: the checks run (and are tested) without vLLM."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from ..desk.admission import check_request_id
from ..errors import MAX_DURATION_S, EngineRequestError

#: Every key of ``kv_connector_extra_config`` and its default (docs/vllm.md lists them).
DEFAULTS: dict[str, Any] = {
    "engine_socket": None,  # required
    "send_to": [],
    "lease_s": 60.0,
    "deadline_s": 60.0,
    "max_pinned_blocks": None,  # half the KV cache
    "recv_slack_s": 5.0,
    "from_site": None,
    "prefix_inventory": True,
    "prefix_salt": None,  # the model directory's name and the dtype
    "site": None,  # asked from the agent
    "engine_name": None,  # vllm-<pid>
    "staging_mb": 1024,
    "staging": False,
}


class BadParam(ValueError):
    """A field the connector cannot use; the message names it and says why."""


def _show(v: Any) -> str:
    """A value for a message: short (a client may send megabytes)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def duration(key: str, v: Any) -> float:
    """Seconds in (0, MAX_DURATION_S]: what the agent accepts for a lease, deadline or ttl."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadParam(f"{key} must be a number of seconds, got {_show(v)}")
    if not 0 < v <= MAX_DURATION_S:  # also nan and inf (and ints too large for a float)
        raise BadParam(f"{key} must be in (0, {MAX_DURATION_S}] seconds, got {_show(v)}")
    return float(v)


MAX_DESTINATIONS = 64  # per send: each is a transfer reading the same blocks


def destinations(key: str, v: Any) -> list[str]:
    """``"B"`` or ``"B/b1"`` (one destination, never split into characters) or a list of them."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise BadParam(f"{key} must be a destination (\"site\" or \"site/node\") or a list of them, got {_show(v)}")
    if len(items) > MAX_DESTINATIONS:
        raise BadParam(f"{key} names {len(items)} destinations (at most {MAX_DESTINATIONS})")
    seen: set[str] = set()
    for d in items:
        if not isinstance(d, str) or not d:
            raise BadParam(f"{key} must name destinations as non-empty strings, got {_show(d)}")
        if d in seen:
            raise BadParam(f"{key} names {_show(d)} twice")
        seen.add(d)
    sites = {d for d in items if "/" not in d}  # a site: whichever of its nodes the agent picks
    if any(d.partition("/")[0] in sites for d in items if "/" in d):
        raise BadParam(f"{key} names a site and one of its nodes, which may be the same peer: {_show(items)}")
    return list(items)


def request_id(key: str, v: Any) -> str:
    """A transfer name the agent accepts (``check_request_id``: 1..256 bytes of UTF-8, not NUL-led)."""
    if not isinstance(v, str):
        raise BadParam(f"{key} must be a string, got {_show(v)}")
    try:
        check_request_id(v)
    except UnicodeError:
        raise BadParam(f"{key} is not valid UTF-8 (a lone surrogate)") from None
    except EngineRequestError as exc:
        msg = str(exc)
        raise BadParam(f"{key} {msg.removeprefix('request_id ')}" if msg.startswith("request_id ")
                       else f"{key}: {msg}") from None
    return v


def _site(key: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise BadParam(f"{key} must be a site name, got {_show(v)}")
    return v


# ------------------------------------------------------------------ the connector's config
@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    engine_socket: str
    send_to: list[str]
    lease_s: float
    deadline_s: float
    max_pinned_blocks: int | None
    recv_slack_s: float
    from_site: str | None
    prefix_inventory: bool
    prefix_salt: str | None
    site: str | None
    engine_name: str | None
    staging_mb: int
    staging: bool


def parse_config(extra: Any) -> ConnectorConfig:
    """``kv_connector_extra_config``, checked: ``ValueError`` naming the first bad key."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"pdd-wire: kv_connector_extra_config must be a JSON object, got {_show(extra)}")
    for key in extra:
        if key not in DEFAULTS:
            near = difflib.get_close_matches(str(key), list(DEFAULTS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(DEFAULTS)})"
            raise ValueError(f"pdd-wire: kv_connector_extra_config[{key!r}]: unknown key{hint}")
    if not extra.get("engine_socket"):
        raise ValueError("pdd-wire: kv_connector_extra_config['engine_socket'] (the agent's engine socket) "
                         "is required")
    vals: dict[str, Any] = {}
    for key, check in _CHECKS.items():
        v = extra.get(key)
        try:
            vals[key] = DEFAULTS[key] if v is None else check(key, v)
        except BadParam as exc:
            raise ValueError(f"pdd-wire: kv_connector_extra_config[{key!r}]: {str(exc).removeprefix(key + ' ')}") \
                from None
    cfg = ConnectorConfig(**vals)
    if cfg.lease_s + cfg.deadline_s > MAX_DURATION_S:
        raise ValueError(f"pdd-wire: kv_connector_extra_config['deadline_s']: a send's deadline is lease_s + "
                         f"deadline_s, which must be at most {MAX_DURATION_S} s")
    return cfg


def _text(key: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise BadParam(f"{key} must be a non-empty string, got {_show(v)}")
    return v


def _flag(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadParam(f"{key} must be true or false, got {_show(v)}")
    return v


def _count(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadParam(f"{key} must be a positive integer, got {_show(v)}")
    return v


_CHECKS = {"engine_socket": _text, "send_to": destinations, "lease_s": duration, "deadline_s": duration,
           "max_pinned_blocks": _count, "recv_slack_s": duration, "from_site": _site, "prefix_inventory": _flag,
           "prefix_salt": _text, "site": _site, "engine_name": _text, "staging_mb": _count, "staging": _flag}


# ------------------------------------------------------------------ per request
def transfer_kind(params: Any, producer: bool, consumer: bool) -> str | None:
    """'produce', 'consume' or None for a request's ``kv_transfer_params``."""
    if not isinstance(params, Mapping) or not params or params.get("pdd_error") is not None:
        return None  # pdd_error: a prefill's answer that says it sent nothing: never a load
    if "do_remote_prefill" in params or "do_remote_decode" in params:  # vLLM's P/D form
        if params.get("do_remote_prefill"):  # decode's side (truthy, as vLLM itself reads it)
            return "consume" if consumer else None
        if params.get("do_remote_decode"):  # prefill's side
            return "produce" if producer else None
        return None  # both false
    if "pdd_request_id" not in params:
        return None
    # The older form: send_to asks a producer to send; on a consumer-only engine (decode given
    # what prefill returned) it never does.
    if producer and ("send_to" in params or not consumer):
        return "produce"
    return "consume" if consumer else None


@dataclasses.dataclass
class ProduceParams:
    rid: str | None = None  # None: the default name
    to: list[str] | None = None  # None: the config's
    lease_s: float | None = None
    deadline_s: float | None = None


def produce_params(params: Mapping[str, Any]) -> ProduceParams:
    """A producer's fields, checked (``BadParam``); None where the request leaves them out."""
    out = ProduceParams()
    if params.get("pdd_request_id") is not None:
        out.rid = request_id("pdd_request_id", params["pdd_request_id"])
    if params.get("send_to") not in (None, []):
        out.to = destinations("send_to", params["send_to"])
    if params.get("lease_s") is not None:
        out.lease_s = duration("lease_s", params["lease_s"])
    if params.get("deadline_s") is not None:
        out.deadline_s = duration("deadline_s", params["deadline_s"])
    return out


@dataclasses.dataclass
class ConsumeParams:
    rid: str
    num_tokens: int | None = None  # None: the whole prompt
    from_site: str | None = None
    lease_s: float | None = None  # None: the older form; the receive waits the agent's post_ttl_s
    lease_started: float | None = None


def consume_params(params: Mapping[str, Any]) -> ConsumeParams:
    """A consumer's fields, checked (``BadParam``)."""
    if params.get("pdd_request_id") is None:
        raise BadParam("pdd_request_id is missing (not a pdd-wire prefill's params)")
    out = ConsumeParams(request_id("pdd_request_id", params["pdd_request_id"]))
    n = params.get("num_tokens")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise BadParam(f"num_tokens must be a non-negative integer, got {_show(n)}")
        out.num_tokens = n
    site = params.get("remote_site")
    out.from_site = _site("remote_site", site) if site is not None else _site("from_site", params.get("from_site"))
    if params.get("lease_s") is not None:
        out.lease_s = duration("lease_s", params["lease_s"])
        started = params.get("lease_started")
        if started is not None:
            if isinstance(started, bool) or not isinstance(started, (int, float)) or not 0 <= started <= 1e11:
                raise BadParam(f"lease_started must be a wall-clock time in seconds, got {_show(started)}")
            out.lease_started = float(started)
    return out
