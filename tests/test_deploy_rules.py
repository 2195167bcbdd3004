"""deploy/prometheus/pdd-wire.rules.yml, the alerting rules an operator loads as they are: each
metric they name is one a running agent (a fleet member, so its fleet metrics too) or router
exports, with the labels the rules select and group by; and every alert of docs/operator.md's
table is among them.

A real fleet agent (one etcd member) and a real router, their ``/metrics`` read over HTTP.
"""

from __future__ import annotations

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
METRIC = re.compile(r"\b(pddwire_[a-z0-9_]+)(\{[^}]*\})?")
BY = re.compile(r"\bby \(([^)]*)\)")
PROMETHEUS_LABELS = {"instance", "job"}  # added by the scrape


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


async def test_every_metric_the_rules_name_is_exported_with_their_labels(tmp_sock_dir, etcd):
    agent = Agent(cfgmod.loads(fleet_toml(tmp_sock_dir, "A", "a1", etcd.endpoints, "rules", lease_ttl_s=30)))
    await agent.start()
    router = await Router(rcfg.validate(rcfg.RouterConfig(
        listen=rcfg.Listen(address="127.0.0.1:0"),
        pools=rcfg.Pools(P=[rcfg.Member(url="http://127.0.0.1:9", site="A")],
                         MD=[rcfg.Member(url="http://127.0.0.1:9", site="B")])))).start()
    try:
        assert agent.admin is not None and agent.admin.address
        agent_page = await _scrape(f"http://{agent.admin.address}/metrics")
        router_page = await _scrape(f"{router.url}/metrics")
    finally:
        await router.stop()
        await agent.shutdown(0)
    pages = {"pdd-wire-agent": exported(agent_page), "pdd-wire-router": exported(router_page)}
    alerts = rules()
    assert {a["group"] for a in alerts} == set(pages)
    for a in alerts:
        assert a["severity"] in ("critical", "warning", "info") and a["summary"], a
        expr = a["expr"]
        if expr.startswith("up{"):  # the scrape itself
            assert a["for"] == "1m", a
            continue
        found = pages[a["group"]]
        named = METRIC.findall(expr)
        assert named, a
        for name, _ in named:
            assert name in found, f"{a['alert']}: {name} is not on the {a['group']}'s /metrics page"
        # Labels the rule selects or groups by: the metric's own, or the scrape's.
        labels = set(re.findall(r"([a-z_]+)\s*[!=]~?\"", "".join(s for _, s in named)))
        for by in BY.findall(expr):
            labels |= {x.strip() for x in by.split(",")}
        have = set().union(*(found[n] for n, _ in named)) | PROMETHEUS_LABELS
        # A metric with labels shows them only once a child exists: those not shown yet are
        # checked against the metric's declared labels (prometheus_client's collectors).
        declared = _declared(agent if a["group"] == "pdd-wire-agent" else router, [n for n, _ in named])
        assert labels <= have | declared, f"{a['alert']}: labels {sorted(labels - have - declared)} unknown"


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
