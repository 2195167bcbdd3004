"""The router's configuration: msgspec structs read from TOML, every key validated.

Same style as :mod:`pdd_wire.config`: a bad file raises :class:`~pdd_wire.errors.ConfigError`
naming the dotted key (an unknown key with a did-you-mean hint). Without a file the router runs
on :func:`default_config`, which fronts ``vllm serve`` instances on fixed loopback ports beside
the agents of ``pdd-wired --site A`` and ``--site B`` (the embedded default of
:mod:`pdd_wire.config`).

.. code-block:: toml

    [listen]
    address = "127.0.0.1:8000"

    [request]
    deadline_s = 600

    [[pools.P]]                       # prefill, site A
    url = "http://127.0.0.1:8100"     # a `vllm serve` (kv_producer, PddWireConnector)
    engine_socket = "/run/pdd-wire/pdd-wire-A.sock"   # the agent that vLLM uses

    [[pools.MD]]                      # main decode, site B
    url = "http://127.0.0.1:8200"     # a `vllm serve` (kv_consumer)
    engine_socket = "/run/pdd-wire/pdd-wire-B.sock"
    site = "B"
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from ..config import EtcdTls, default_engine_socket, engine_url, is_loopback, parse_hostport, validate_etcd
from ..errors import ConfigError
from ..policy import HandoffPolicy

_cfg = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}


class Member(msgspec.Struct, **_cfg):
    """One ``vllm serve`` instance and the agent its PddWireConnector uses."""

    url: str
    """The OpenAI server's base URL (``http://host:port``)."""
    engine_socket: str = ""
    """The engine socket of the agent this vLLM's connector talks to (the router asks P's agent
    for the pipeline choice there). "" = none known."""
    admin: str = ""
    """That agent's admin ``host:port`` (metrics, status), for operators and tests; "" = none."""
    site: str = ""
    """The agent's site (RLD, MD: where P's KV is sent, ``send_to``); "" = not named."""
    node: str = ""
    """The agent's node (``send_to`` then names ``site/node``); "" = not named."""
    max_num_seqs: int = 0
    """RLD: the server's ``--max-num-seqs``. Its live load is (running + waiting requests) over
    this, or its KV cache use when higher (``rld_load``). 0 = not known: the KV cache use alone,
    and 1 whenever requests wait."""


class Pools(msgspec.Struct, **_cfg):
    P: list[Member] = []
    """Prefill instances (site A): ``kv_role = "kv_producer"``."""
    RLD: list[Member] = []
    """Relay-decode instances (site A): ``kv_consumer``, beside P."""
    MD: list[Member] = []
    """Main-decode instances (site B): ``kv_consumer``, across the WAN."""


class Listen(msgspec.Struct, **_cfg):
    address: str = "127.0.0.1:8000"
    """host:port of the OpenAI front."""


class Request(msgspec.Struct, **_cfg):
    deadline_s: float = 600.0
    """A request ends by then, whatever it is waiting for (upstream requests are closed)."""
    connect_s: float = 5.0
    """Connecting to a vLLM server; also each member's whole answer to ``/healthz``'s probe and
    to ``/v1/models``."""
    prefill_lease_s: float | None = None
    """``lease_s`` asked of prefill (how long its KV waits for decode); None = the connector's."""
    body_s: float = 30.0
    """A client's request body must have arrived this long after its headers (at most
    ``deadline_s``); else 408, keep-alive off (a trickled body would hold a slot of
    ``max_inflight``)."""
    stream_silent_s: float = 120.0
    """A streamed answer relayed from one member (P-MD's MD, P-RLD's RLD or P) silent this long
    after its first event has failed: the client gets a 502 error event and ``[DONE]``, the
    upstream request is closed (vLLM aborts it). Its first event is waited for up to the
    deadline (a queued request, a prompt's KV on its way); P-RLD-MD has ``handoff.rld_silent_s``
    and ``handoff.continue_s`` instead."""
    max_inflight: int = 1024
    """Client requests to ``/v1/completions`` and ``/v1/chat/completions`` in flight at once,
    from their arrival to the last byte of their answer. One more is answered ``503`` at once
    (``Retry-After: 1``), touching no upstream; ``/healthz``, ``/metrics`` and ``/v1/models``
    do not count. It also sizes the router's upstream connection pool (:mod:`.limit`). At least 1."""


class Choice(msgspec.Struct, **_cfg):
    """The per-request pipeline choice (asked of P's agent: ``choose_pipeline``)."""

    ask_agent: bool = True
    """Ask P's agent for each request. False: every request is P-MD (nothing asked)."""
    kv_bytes_per_token: int = 1024
    """The served model's KV bytes per prompt token (all layers, K and V): what the agent's WAN
    time prediction is made of. The tests' tiny Llama: 2 layers x 2 x 2 heads x 64 x 4 bytes."""
    block_tokens: int = 0
    """vLLM's ``--block-size``: with ``prefix_salt``, the router sends the prompt's chained block
    hashes, and the agent matches them against MD's prefix inventory. 0 = no hashes."""
    prefix_salt: str = ""
    """The connector's ``prefix_salt`` (default there: model directory name + "/" + dtype)."""
    timeout_s: float = 2.0
    """Tokenizing the prompt (P's ``/tokenize``) and the agent's answer together; past it the
    request runs P-MD (fallback ``choice_failed``)."""
    md_candidates: int = 4
    """With several MD members and block hashes: the agent is asked the prefix each of the
    this many least-loaded members holds, and the longest wins (least-loaded among equals)."""


class Handoff(msgspec.Struct, **_cfg):
    """P-RLD-MD: when RLD's output is handed to MD (one-shot: RLD stops at position m, MD
    continues from the prompt and the m emitted tokens; catch-up: MD first absorbs RLD's tokens
    in batches while RLD goes on, so that its last extend is small)."""

    mode: typing.Literal["auto", "one-shot", "catch-up"] = "auto"
    """``auto``: chosen per request from RLD's live load and MD's gap
    (:func:`pdd_wire.policy.choose_handoff_mode`); the others force one mode."""
    policy: HandoffPolicy = HandoffPolicy()
    """``busy_load``, ``catchup_gap_tokens``, ``max_catchup_rounds`` (pdd_wire.policy)."""
    absorb_s: float = 10.0
    """Catch-up: one absorb request to MD; not answered by then, MD is too slow (fallback
    ``md_not_ready``) and RLD keeps the request."""
    non_streamed: bool = True
    """Run non-streamed completions P-RLD-MD too (the router streams them from RLD and MD and
    answers with the whole body). False: they run P-MD (fallback ``p_rld_md_not_streamed``)."""
    min_rld_tokens: int = 0
    """RLD emits at least this many tokens before MD may take over."""
    max_rld_tokens: int | None = None
    """None: no limit. Else RLD emits at most this many (0: none, MD makes every token): there
    the router waits for MD to hold the KV (up to ``md_ready_s``) instead of relaying more of RLD
    (bounds RLD's share)."""
    md_ready_s: float = 30.0
    """MD not holding the prompt's KV by then (counted from the request's start): RLD keeps the
    request to its end (fallback ``md_not_ready``)."""
    rld_silent_s: float = 30.0
    """Before the switch: RLD's stream silent this long -- no answer or token since it was asked,
    or none between two events the router waits for -- has failed: MD takes the output over
    from where RLD left it, as for any RLD failure (fallback ``rld_failed``)."""
    continue_s: float = 30.0
    """After the switch: MD's stream (or a hand-back's) silent this long -- no token since it
    was asked, or between two events -- has failed: the output goes back to RLD
    (``md_failed_after_switch``)."""


class RldLoad(msgspec.Struct, **_cfg):
    """RLD's live load for the handoff mode, read from each RLD member's vLLM ``/metrics``
    (``vllm:num_requests_running``, ``..._waiting``, ``vllm:kv_cache_usage_perc``): it counts
    every router's requests and any other client's."""

    interval_s: float = 0.5
    """At most one scrape per RLD member per this, and only while P-RLD-MD requests run."""
    timeout_s: float = 1.0
    """One scrape."""
    max_age_s: float = 5.0
    """An older figure is no figure: the load is unknown and the handoff one-shot."""


class Log(msgspec.Struct, **_cfg):
    level: typing.Literal["debug", "info", "warning", "error"] = "info"
    format: typing.Literal["auto", "json", "console"] = "auto"


class RouterFleet(msgspec.Struct, **_cfg):
    """The pools from the fleet's membership in etcd (router/discovery.py), besides those above."""

    etcd: list[str] = []
    """etcd client URLs; [] = the pools are the configured ones only."""
    cluster: str = "pdd"
    """The agents' ``fleet.cluster``."""
    request_s: float = 2.0
    tls: EtcdTls = EtcdTls()

    def __post_init__(self) -> None:
        try:  # the agent's checks of its [fleet] table: URLs, TLS to etcd, cluster, request_s
            validate_etcd(self.etcd, self.tls, self.cluster, self.request_s)
        except ConfigError as exc:  # a ValueError here is reported at `fleet`, naming the key inside
            raise ValueError(f"{exc.key}: {exc.problem}") from None


class RouterConfig(msgspec.Struct, **_cfg):
    listen: Listen = Listen()
    request: Request = Request()
    pools: Pools = Pools()
    choice: Choice = Choice()
    handoff: Handoff = Handoff()
    rld_load: RldLoad = RldLoad()
    log: Log = Log()
    fleet: RouterFleet = RouterFleet()


def _check_url(url: str, key: str) -> None:
    if not engine_url(url):  # the agents' rule for the engine URLs they register
        raise ConfigError(key, f"{url!r} is not an http(s)://host:port URL")


def validate(cfg: RouterConfig) -> RouterConfig:
    parse_hostport(cfg.listen.address, "listen.address")
    for key in ("deadline_s", "connect_s", "body_s", "stream_silent_s"):
        if not getattr(cfg.request, key) > 0:
            raise ConfigError(f"request.{key}", f"must be > 0, got {getattr(cfg.request, key)}")
    if cfg.request.prefill_lease_s is not None and not cfg.request.prefill_lease_s > 0:
        raise ConfigError("request.prefill_lease_s", "must be > 0")
    if cfg.request.max_inflight < 1:
        raise ConfigError("request.max_inflight", f"must be >= 1, got {cfg.request.max_inflight}")
    for i, url in enumerate(cfg.fleet.etcd):
        # The router sends users' prompts where etcd's records say: plaintext only on loopback.
        u = urlsplit(url)
        if u.scheme.lower() == "http" and not is_loopback(u.hostname or ""):
            raise ConfigError(f"fleet.etcd[{i}]", f"{url!r}: the router takes its targets from etcd, so it "
                                                  "reaches etcd over TLS (https://, fleet.tls.ca); plaintext "
                                                  "only to a loopback etcd")
    for role in ("P", "MD"):
        if not getattr(cfg.pools, role) and not cfg.fleet.etcd:
            raise ConfigError(f"pools.{role}", "needs at least one member (or [fleet] to find them in etcd)")
    for role in ("P", "RLD", "MD"):
        for i, m in enumerate(getattr(cfg.pools, role)):
            _check_url(m.url, f"pools.{role}[{i}].url")
            if m.admin:
                parse_hostport(m.admin, f"pools.{role}[{i}].admin")
            if m.max_num_seqs < 0:
                raise ConfigError(f"pools.{role}[{i}].max_num_seqs", "must be >= 0 (0: not known)")
    h = cfg.handoff
    if h.min_rld_tokens < 0:
        raise ConfigError("handoff.min_rld_tokens", "must be >= 0")
    if h.max_rld_tokens is not None and h.max_rld_tokens < h.min_rld_tokens:
        raise ConfigError("handoff.max_rld_tokens", "must be at least handoff.min_rld_tokens (unset: no limit)")
    if not h.md_ready_s > 0:
        raise ConfigError("handoff.md_ready_s", "must be > 0")
    if not h.absorb_s > 0:
        raise ConfigError("handoff.absorb_s", "must be > 0")
    for key in ("continue_s", "rld_silent_s"):
        if not getattr(h, key) > 0:
            raise ConfigError(f"handoff.{key}", f"must be > 0, got {getattr(h, key)}")
    for key in ("interval_s", "timeout_s", "max_age_s"):
        if not getattr(cfg.rld_load, key) > 0:
            raise ConfigError(f"rld_load.{key}", f"must be > 0, got {getattr(cfg.rld_load, key)}")
    if cfg.choice.md_candidates < 1:
        raise ConfigError("choice.md_candidates", "must be >= 1")
    if cfg.choice.kv_bytes_per_token <= 0:
        raise ConfigError("choice.kv_bytes_per_token", "must be > 0")
    if not cfg.choice.timeout_s > 0:
        raise ConfigError("choice.timeout_s", "must be > 0")
    if cfg.choice.block_tokens < 0:
        raise ConfigError("choice.block_tokens", "must be >= 0")
    if cfg.choice.ask_agent:
        for i, m in enumerate(cfg.pools.MD):
            if not m.site:
                raise ConfigError(f"pools.MD[{i}].site", "required when choice.ask_agent (the agent's "
                                                         "figures are for the link to that site)")
        for i, m in enumerate(cfg.pools.RLD):  # only the agent's choice sends requests to RLD
            if not m.site:
                raise ConfigError(f"pools.RLD[{i}].site", "required when choice.ask_agent (P's connector "
                                                          "sends RLD's KV there; without it, to its own "
                                                          "send_to, and RLD would wait for KV that never comes)")
    return cfg


_KEY = re.compile(r"at `\$(.*?)`")


def _key_and_hint(msg: str) -> tuple[str, str]:
    """The dotted key a msgspec error names, and a did-you-mean hint for an unknown key."""
    m = _KEY.search(msg)
    path = (m.group(1) if m else "").lstrip(".")
    unknown = re.search(r"unknown field `([^`]+)`", msg)
    missing = re.search(r"missing required field `([^`]+)`", msg)
    leaf = (unknown or missing).group(1) if (unknown or missing) else ""
    key = ".".join(x for x in (path, leaf) if x) or "(top level)"
    if "Invalid enum value" in msg:
        values = typing.get_args(_type_at(path))
        return key, f"; valid: {', '.join(map(str, values))}" if values else ""
    if not unknown:
        return key, ""
    t = _type_at(path)
    if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
        return key, ""
    names = [f.name for f in msgspec.structs.fields(t)]
    close = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
    if close:
        return key, f"; did you mean {' or '.join(repr(c) for c in close)}?"
    return key, f"; valid keys here: {', '.join(names)}"


def _type_at(path: str) -> typing.Any:
    """The type of the config field at a dotted path (list items for ``[i]``); None: none."""
    t: typing.Any = RouterConfig
    for part in re.sub(r"\[\d+\]", "", path).split(".") if path else []:
        if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
            return None
        t = {f.name: f.type for f in msgspec.structs.fields(t)}.get(part)
        args = typing.get_args(t)
        if typing.get_origin(t) is list and args:
            t = args[0]
    return t


def loads(text: str | bytes) -> RouterConfig:
    try:
        raw = msgspec.toml.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError("(file)", f"not valid TOML: {exc}") from exc
    try:
        cfg = msgspec.convert(raw, RouterConfig)
    except msgspec.ValidationError as exc:
        key, hint = _key_and_hint(str(exc))
        raise ConfigError(key, str(exc).split(" - at ")[0] + hint) from exc
    return validate(cfg)


def load(path: str | Path) -> RouterConfig:
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError("(file)", f"cannot read {str(path)!r}: {exc.strerror}") from exc
    return loads(text)


# vLLM ports of the embedded default: P and RLD beside agent A, MD beside agent B.
DEFAULT_PORTS = {"P": 8100, "RLD": 8101, "MD": 8200}

DEFAULT_TEMPLATE = """\
# pdd-wire router embedded default: the OpenAI front on 127.0.0.1:8000 over `vllm serve`
# instances on this machine, beside the agents of `pdd-wired --site A` and `--site B`.
[listen]
address = "127.0.0.1:8000"

[request]
deadline_s = 600

[[pools.P]]
url = "http://127.0.0.1:{P}"
engine_socket = "{sock_a}"
admin = "127.0.0.1:7701"
site = "A"
node = "a1"

[[pools.MD]]
url = "http://127.0.0.1:{MD}"
engine_socket = "{sock_b}"
admin = "127.0.0.1:7702"
site = "B"
node = "b1"
"""


def default_toml() -> str:
    return DEFAULT_TEMPLATE.format(sock_a=default_engine_socket("A"), sock_b=default_engine_socket("B"),
                                   **DEFAULT_PORTS)


def default_config() -> RouterConfig:
    return loads(default_toml())
