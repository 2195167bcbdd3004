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
import pytest

from pdd_wire import config as cfgmod
from pdd_wire.agent import Agent
from pdd_wire.router import Router
from pdd_wire.router import config as rcfg
from support.fleet import etcd_cluster
from test_fleet import fleet_toml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "pdd-wire.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdd-wire.json"
METRIC = re.compile(r"\b(pddwire_[a-z0-9_]+)(\{[^}]*\})?")
BY = re.compile(r"\bby \(([^)]*)\)")
PROMETHEUS_LABELS = {"instance", "job"}  # added by the scrape
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def rules() -> list[dict[str, str]]:
    """The rules file's alerts (its fixed layout: ``- alert:`` then indented keys), in order."""
    out: list[dict[str, str]] = []
    group = ""
    for line in RULES.read_text().splitlines():
        if m := re.match(r"\s+- name: (\S+)$", line):
            group = m[1]
        elif m := re.match(r"\s+- alert: (\S+)$", line):
            out.append({"group": group, "alert": m[1]})
        elif out and (m := re.match(r"\s+(expr|for|severity|summary): (.+)$", line)):
            out[-1][m[1]] = m[2].strip('"')
    return out


def exported(text: str) -> dict[str, set[str]]:
    """Metric family (as written on ``# TYPE`` lines) -> the label names of its samples."""
    names: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.setdefault(line.split()[2], set())
    for line in text.splitlines():
        if (m := re.match(r"([a-z0-9_]+)\{([^}]*)\}", line)) and m[1] in names:
            names[m[1]] |= {kv.split("=")[0] for kv in m[2].split(",") if kv}
    return names


@pytest.fixture(scope="module")
def etcd():
    yield from etcd_cluster(1)


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
        _check(a["alert"], a["expr"], pages)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [(v["name"], v["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 20 and dash["uid"] == "pdd-wire"
    for title, expr in exprs:
        _check(title, expr, pages)


def _check(what: str, expr: str, pages: dict) -> None:
    """Every metric ``expr`` names is on its exporter's page (the router's ``pddwire_router_*``,
    the agent's the rest), and every label it selects or groups by is the metric's own or the
    scrape's."""
    named = METRIC.findall(expr)
    assert named, (what, expr)
    families = []
    for name, _ in named:
        found, owner = pages["router" if name.startswith("pddwire_router_") else "agent"]
        family = next((name.removesuffix(x) for x in HISTOGRAM_SERIES
                       if name.endswith(x) and name.removesuffix(x) in found), name)
        assert family in found, f"{what}: {name} is not on the /metrics page of {type(owner).__name__}"
        families.append((family, found, owner, family != name))
    labels = set(re.findall(r"([a-z_]+)\s*[!=]~?\"", "".join(sel for _, sel in named)))
    for by in BY.findall(expr):
        labels |= {x.strip() for x in by.split(",")}
    labels |= set(re.findall(r"label_values\([a-z0-9_]+, ([a-z_]+)\)", expr))
    have = set(PROMETHEUS_LABELS)
    for family, found, owner, histogram in families:
        # A metric with labels shows them only once a child exists: those not shown yet are
        # taken from the metric's declared labels (prometheus_client's collector).
        have |= found[family] | _declared(owner, [family]) | ({"le"} if histogram else set())
    assert labels <= have, f"{what}: labels {sorted(labels - have)} unknown in {expr}"


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
