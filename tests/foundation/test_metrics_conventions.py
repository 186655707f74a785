"""Every service's /metrics follows the conventions of docs/metrics.md, and the docs and the dashboard say what
the registries really export.

Each service's metrics are created in a registry of their own, every series is given a value, and the text
Prometheus would scrape is parsed: names, types and label sets are compared with docs/metrics.md's tables; units,
`_total` and dcgm-exporter's GPU labels are checked; the Grafana dashboard's queries may use only metrics and
labels the registries export; and any metric name the documentation mentions must exist.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.accounting.metrics import AccountingMetrics, Snapshot
from services.binder.metrics import BinderMetrics
from services.extender import metrics as extender_metrics
from services.node_agent.metrics import AgentMetrics
from shared.ledger.commit_watch import SYNCHRONOUS_STANDBY, Blocked, CommitWatch
from shared.ledger.deadlines import Deadlines
from shared.metrics import GPU_LABELS, NODE_LABELS, SeriesSet

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "k8s" / "base" / "gpushare-dashboard.json"


def documented_labels() -> set[str]:
    """The label names in the first column of docs/metrics.md's label table."""
    text = METRICS_DOC.read_text()
    table = text[text.index("| label | on | value |") :].split("\n\n", 1)[0]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`([A-Za-z_]+)`", row.split("|")[1])}


LABELS = documented_labels()
NOT_BASE_UNITS = re.compile(r"_(mib|gib|mb|gb|kib|pct|percent|ms|milliseconds)(_|$)")
SECTIONS = {
    "accounting": "## Accounting",
    "extender": "## Extender",
    "binder": "## Binder",
    "node agent": "## Node agent",
    "ledger": "## Ledger commits",
}

Exported = dict[str, tuple[str, frozenset[str]]]  # documented name -> (type, label names)


def _give_values(holder: object, registry: CollectorRegistry | None = None) -> None:
    """One series per metric of `holder` (its attributes, or a module's globals), registered in `registry`."""
    for metric in vars(holder).values():
        if isinstance(metric, SeriesSet):
            metric = metric.gauge
        if not isinstance(metric, Counter | Gauge | Histogram):
            continue
        if registry is not None:
            registry.register(metric)
        child = metric.labels(*["x"] * len(metric._labelnames)) if metric._labelnames else metric
        if isinstance(metric, Histogram):
            child.observe(0.5)
        elif isinstance(metric, Gauge):
            child.set(1)
        else:
            child.inc()


def _accounting() -> CollectorRegistry:
    metrics = AccountingMetrics()
    metrics.collector.snapshot = Snapshot(
        nodes=["n1"],
        gpus=[("n1", 0, "GPU-1", "Tesla-T4", 15360, 2048, 1024)],
        namespaces={"team-a": (2048, 0)},
        quotas=[{"namespace": "team-a", "memory_mib": 4096}],
        pending_by_reason={"needs N GiB": 1},
        pod_ratios=[("team-a", "p", "Deployment", "web", 0.5)],
    )
    _give_values(metrics)
    return metrics.registry


def _extender() -> CollectorRegistry:
    registry = CollectorRegistry()
    _give_values(extender_metrics, registry)
    return registry


def _binder() -> CollectorRegistry:
    metrics = BinderMetrics()
    _give_values(metrics)
    return metrics.registry


def _node_agent() -> CollectorRegistry:
    metrics = AgentMetrics()
    _give_values(metrics)
    return metrics.registry


def _ledger() -> CollectorRegistry:
    """The commit watch's metrics (every process with a database registers them), while it cannot commit."""
    watch = CommitWatch(Deadlines())
    watch.blocked = Blocked("a reason", SYNCHRONOUS_STANDBY, time.monotonic(), held=True)
    registry = CollectorRegistry()
    registry.register(watch.collector())
    return registry


REGISTRIES = {
    "accounting": _accounting,
    "extender": _extender,
    "binder": _binder,
    "node agent": _node_agent,
    "ledger": _ledger,
}


def exported(service: str) -> Exported:
    """What the service's /metrics holds, by the name the docs use (counters with `_total`)."""
    text = generate_latest(REGISTRIES[service]()).decode()
    out: Exported = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("gpushare_") or family.name.endswith("_created"):
            continue  # `_created`: the time a counter or histogram began, which prometheus_client adds
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples if not s.name.endswith("_created") for k in s.labels} - {"le"}
        assert family.samples, f"{service}: {name} exported no sample"
        out[name] = (family.type, frozenset(labels))
    return out


def documented(service: str) -> Exported:
    """The table of `service` in docs/metrics.md."""
    text = METRICS_DOC.read_text()
    section = text[text.index(SECTIONS[service]) :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    out: Exported = {}
    for line in section.splitlines():
        match = re.match(r"^\|\s*`(gpushare_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if match:
            labels = frozenset(x.strip() for x in match.group(3).split(",") if x.strip())
            out[match.group(1)] = (match.group(2), labels)
    return out


@pytest.mark.parametrize("service", sorted(REGISTRIES))
def test_the_docs_table_is_what_the_registry_exports(service: str) -> None:
    have, doc = exported(service), documented(service)
    assert have, service
    assert sorted(set(have) - set(doc)) == [], f"exported but not in docs/metrics.md ({service})"
    assert sorted(set(doc) - set(have)) == [], f"in docs/metrics.md but not exported ({service})"
    for name, (kind, labels) in have.items():
        assert doc[name] == (kind, labels), f"{name}: docs say {doc[name]}, the registry exports {(kind, labels)}"


@pytest.mark.parametrize("service", sorted(REGISTRIES))
def test_prometheus_conventions_and_dcgm_labels(service: str) -> None:
    prefix = {
        "extender": "gpushare_extender_",
        "binder": "gpushare_binder_",
        "node agent": "gpushare_node_agent_",
        "ledger": "gpushare_ledger_",
    }
    for name, (kind, labels) in exported(service).items():
        assert name.startswith(prefix.get(service, "gpushare_")), name
        assert not NOT_BASE_UNITS.search(name), f"{name}: use base units (bytes, ratios, seconds)"
        assert name.endswith("_total") == (kind == "counter"), f"{name} ({kind}): `_total` is for counters only"
        assert labels <= LABELS, f"{name}: labels {sorted(labels - LABELS)} are not in docs/metrics.md's list"
        if "UUID" in labels or "gpu" in labels:
            # a GPU series carries exactly dcgm-exporter's labels; one about a pod on a GPU adds namespace and pod
            # (and container, as dcgm-exporter's Kubernetes mapping does)
            pod = {"namespace", "pod", "container"}
            assert labels - pod == set(GPU_LABELS), f"{name}: a GPU series carries {GPU_LABELS}"
        elif "Hostname" in labels:
            assert labels == set(NODE_LABELS), name
        if name.endswith("_ratio") or "utilization" in name:
            assert name.endswith("_ratio"), f"{name}: a share is a ratio from 0 to 1"


def test_counters_are_named_with_total_in_the_code() -> None:
    sources = [p for d in ("services", "shared") for p in (ROOT / d).rglob("*.py")]
    names = [n for p in sources for n in re.findall(r"\bCounter\(\s*\"([a-z0-9_]+)\"", p.read_text())]
    assert len(names) >= 10
    assert [n for n in names if not n.endswith("_total")] == []


def _all_exported() -> Exported:
    out: Exported = {}
    for service in REGISTRIES:
        out |= exported(service)
    return out


def _stem(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_the_dashboard_plots_exported_metrics_by_exported_labels() -> None:
    have = _all_exported()
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [(p["title"], t) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 8
    joins = 0
    for title, target in targets:
        expr = target["expr"]
        names = {_stem(n) for n in re.findall(r"\bgpushare_[a-z0-9_]+", expr)}
        assert names, f"{title}: {expr} plots no gpushare metric"
        missing = sorted(n for n in names if n not in have)
        assert not missing, f"{title}: {missing} are exported by no service"
        labels = set().union(*(have[n][1] for n in names))
        used = {
            label.strip()
            for group in re.findall(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr)
            for label in group.split(",")
            if label.strip()
        } | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert used <= labels | {"le"}, f"{title}: {expr} uses labels {sorted(used - labels)} no metric there has"
        joins += "DCGM_" in expr and "on (UUID)" in expr
    assert joins >= 1, "a panel joins with dcgm-exporter on UUID"


# PostgreSQL roles share the prefix (migration 0007's service roles, and the schema owner the init script makes)
_ROLES_MIGRATION = ROOT / "migrations" / "versions" / "0007_service_roles.py"
DATABASE_ROLES = {*re.findall(r'"(gpushare_[a-z_]+)": \{', _ROLES_MIGRATION.read_text()), "gpushare_migrate"}


def test_every_metric_the_docs_mention_is_exported() -> None:
    assert {"gpushare_extender", "gpushare_binder", "gpushare_accounting"} <= DATABASE_ROLES
    have = {_stem(n) for n in _all_exported()}
    texts = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    texts[METRICS_DOC] = texts[METRICS_DOC].split("## Renamed")[0]  # the table of former names
    for path, text in texts.items():
        mentioned = {n for n in re.findall(r"\bgpushare_[a-z0-9_]*[a-z0-9]\b", text)}  # `gpushare_extender_*`: a prefix
        unknown = sorted(n for n in mentioned - DATABASE_ROLES if _stem(n) not in have)
        assert not unknown, f"{path.relative_to(ROOT)} mentions metrics no service exports: {unknown}"


def test_a_series_set_keeps_only_the_series_of_its_last_publish() -> None:
    registry = CollectorRegistry()
    series = SeriesSet(Gauge("demo_pod_bytes", "demo", ["pod"], registry=registry))
    series.publish({("a",): 1.0, ("b",): 2.0})
    series.publish({("b",): 3.0})
    assert registry.get_sample_value("demo_pod_bytes", {"pod": "a"}) is None
    assert registry.get_sample_value("demo_pod_bytes", {"pod": "b"}) == 3.0
    series.publish({("a",): 4.0})  # a pod name used again comes back as a fresh series
    assert registry.get_sample_value("demo_pod_bytes", {"pod": "a"}) == 4.0
    assert registry.get_sample_value("demo_pod_bytes", {"pod": "b"}) is None
