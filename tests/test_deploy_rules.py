"""deploy/prometheus/pdd-wire.rules.yml (the alerting rules) and deploy/grafana/pdd-wire.json
(the dashboard), loaded by an operator as they are: each metric they name is one a running agent
(a fleet member, so its fleet metrics too) or router exports, with the labels they select and
group by; and every alert of docs/operator.md's table is among the rules.

A real fleet agent (one etcd member) and a real router, their ``/metrics`` read over HTTP.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp

from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.router import Router
from pdd_wire.router import config as rcfg
from test_fleet import fleet_toml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "pdd-wire.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdd-wire.json"
METRIC = re.compile(r"\b(pddwire_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r"([a-z_]+)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
BY = re.compile(r"\b(by|without) \(([^)]*)\)")
PROMETHEUS_LABELS = {"instance", "job"}  # added by the scrape
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# Words of the product's source: a label value a rule or a panel selects must be one of them
# (its error code names are upper case; the transfers' outcomes are those names in lower case).
WORDS = {w for f in (ROOT / "pdd_wire").rglob("*.py") for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f.read_text())}


def rules() -> list[dict[str, str]]:
    """The rules file's alerts (its fixed layout: ``- alert:`` then indented keys; an ``expr: >-``
    folded over the lines below it), in order."""
    out: list[dict[str, str]] = []
    group, folding = "", False
    for line in RULES.read_text().splitlines():
        if folding and line.startswith(" " * 10) and line.strip():
            out[-1]["expr"] = (out[-1]["expr"] + " " + line.strip()).strip()
            continue
        folding = False
        if m := re.match(r"\s+- name: (\S+)$", line):
            group = m[1]
        elif m := re.match(r"\s+- alert: (\S+)$", line):
            out.append({"group": group, "alert": m[1]})
        elif out and (m := re.match(r"\s+(expr|for|severity|summary): (.+)$", line)):
            out[-1][m[1]] = "" if m[2] == ">-" else m[2].strip('"')
            folding = m[2] == ">-"
    return out


def exported(text: str) -> dict[str, tuple[str, set[str]]]:
    """Metric family (as written on ``# TYPE`` lines) -> (its type, the label names of its samples)."""
    names: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.setdefault(name, (kind, set()))
    for line in text.splitlines():
        if (m := re.match(r"([a-z0-9_]+)\{([^}]*)\}", line)) and m[1] in names:
            names[m[1]][1].update(kv.split("=")[0] for kv in m[2].split(",") if kv)
    return names


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, url
        return await r.text()


async def test_every_metric_the_rules_and_the_dashboard_name_is_exported_with_their_labels(tmp_sock_dir, etcd):
    agent = Agent(cfgmod.loads(fleet_toml(tmp_sock_dir, "A", "a1", etcd.endpoints, "rules", lease_ttl_s=30)))
    await agent.start()
    router = await Router(rcfg.validate(rcfg.RouterConfig(
        listen=rcfg.Listen(address="127.0.0.1:0"),
        pools=rcfg.Pools(P=[rcfg.Member(url="http://127.0.0.1:9", site="A")],
                         MD=[rcfg.Member(url="http://127.0.0.1:9", site="B")])))).start()
    try:
        assert agent.admin is not None and agent.admin.address
        pages = {"agent": (exported(await _scrape(f"http://{agent.admin.address}/metrics")), agent),
                 "router": (exported(await _scrape(f"{router.url}/metrics")), router)}
    finally:
        await router.stop()
        await agent.shutdown(0)
    alerts = rules()
    assert {a["group"] for a in alerts} == {"pdd-wire-agent", "pdd-wire-router"}
    for a in alerts:
        assert a["severity"] in ("critical", "warning", "info") and a["summary"], a
        if a["expr"].startswith("up{"):  # the scrape itself
            assert a["for"] == "1m", a
            continue
        _check(a["alert"], a["expr"], pages, re.findall(r"\{\{ \$labels\.([a-z_]+) \}\}", a["summary"]))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"], re.findall(r"\{\{([a-z_]+)\}\}", t["legendFormat"]))
             for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [(v["name"], v["query"], []) for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 20 and dash["uid"] == "pdd-wire"
    for title, expr, shown in exprs:
        _check(title, expr, pages, shown)


def _check(what: str, expr: str, pages: dict, shown: list[str]) -> None:
    """Every metric ``expr`` names is on its exporter's page (the router's ``pddwire_router_*``,
    the agent's the rest), a histogram's by one of its series only; each selector's labels are
    its metric's own (or the scrape's), and its values words of the product; what it groups by
    is some metric's labels; and the labels ``shown`` (an alert's summary, a panel's legend)
    survive the aggregation."""
    named = METRIC.findall(expr)
    assert named, (what, expr)
    every = set(PROMETHEUS_LABELS)
    for name, selector in named:
        found, owner = pages["router" if name.startswith("pddwire_router_") else "agent"]
        family = next((name.removesuffix(x) for x in HISTOGRAM_SERIES if name.endswith(x)
                       and name.removesuffix(x) in found), name)
        assert family in found, f"{what}: {name} is not on the /metrics page of {type(owner).__name__}"
        kind, labels = found[family]
        assert (kind == "histogram") == (family != name), f"{what}: {name} ({kind}) in {expr}"
        # A metric with labels shows them only once a child exists: those not shown yet are
        # taken from the metric's declared labels (prometheus_client's collector).
        own = labels | _declared(owner, [family]) | PROMETHEUS_LABELS | ({"le"} if kind == "histogram" else set())
        every |= own
        for label, _, value in MATCHER.findall(selector):
            assert label in own, f"{what}: {name} has no label {label!r}: {expr}"
            if value.startswith("$") or value == ".*":  # a dashboard variable
                continue
            for v in value.split("|"):
                assert re.search(r"[.*+?\[]", v) or v in WORDS or v.upper() in WORDS, \
                    f"{what}: {label}={v!r} is no value the product writes: {expr}"
    grouped = [(how, {x.strip() for x in by.split(",")}) for how, by in BY.findall(expr)]
    for _, g in grouped:
        assert g <= every, f"{what}: grouped by {sorted(g - every)}, no metric's label: {expr}"
    values_of = set(re.findall(r"label_values\([a-z0-9_]+, ([a-z_]+)\)", expr))
    assert values_of <= every, (what, expr)
    survive = every if not grouped else grouped[0][1] - {"le"} if grouped[0][0] == "by" else every - grouped[0][1]
    assert set(shown) <= survive, f"{what}: shows {sorted(set(shown) - survive)}, gone after {expr}"


def _declared(owner, names: list[str]) -> set[str]:
    """The label names ``names`` were declared with in ``owner``'s registry (the fleet's metrics
    are in the agent's)."""
    reg = owner.metrics.registry
    out: set[str] = set()
    for name in names:
        collector = reg._names_to_collectors.get(name.removesuffix("_total")) or reg._names_to_collectors.get(name)
        if collector is not None:
            out |= set(getattr(collector, "_labelnames", ()))
    return out


def test_the_operator_guides_alerts_are_all_in_the_rules_file():
    """Each row of docs/operator.md's alert table names metrics that one rule of the file uses."""
    guide = (ROOT / "docs" / "operator.md").read_text()
    table = guide.split("| alert | expression | why |", 1)[1].split("\n\n", 1)[0]
    exprs = [a["expr"] for a in rules()]
    rows = [r for r in table.splitlines() if r.startswith("| ") and "`" in r]
    assert len(rows) >= 10, rows
    for row in rows:
        first = row.split("|")[2]
        metrics = set(re.findall(r"pddwire_[a-z0-9_]+", first))
        if not metrics:  # /readyz: the scrape's own rule
            assert any(e.startswith('up{job="pdd-wire"}') for e in exprs), row
            continue
        assert any(metrics <= set(re.findall(r"pddwire_[a-z0-9_]+", e)) for e in exprs), row
    assert "deploy/prometheus/pdd-wire.rules.yml" in guide
