"""The base runs every service replicated and keeps it so through voluntary disruptions (issue 32); the binder's
leader election has the Lease its Role allows; docs/operations.md says the replica counts the manifests ship."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.cli import build_parser
from tests.deploy.tools import KUSTOMIZATIONS, NAMESPACE, ROOT, find

REPLICATED = {"gpushare-extender", "gpushare-binder", "gpushare-accounting"}
SCALING = ROOT / "docs" / "operations.md"


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def _selects(pdb: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"].get("labels") or {}
    return pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_replicated_workload_has_one_budget_that_keeps_a_replica_and_lets_a_drain_through(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    objects = rendered[name]
    replicated = [w for w in _workloads(objects) if w["spec"].get("replicas", 1) >= 2]
    assert REPLICATED <= {w["metadata"]["name"] for w in replicated}
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for workload in replicated:
        name, replicas = workload["metadata"]["name"], workload["spec"]["replicas"]
        mine = [b for b in budgets if _selects(b, workload)]
        assert len(mine) == 1, f"{name}: {len(mine)} PodDisruptionBudgets select it"
        spec = mine[0]["spec"]
        kept = spec["minAvailable"] if "minAvailable" in spec else replicas - spec["maxUnavailable"]
        assert 1 <= kept < replicas, f"{name}: the budget keeps {kept} of {replicas} replicas"
    for budget in budgets:
        assert sum(_selects(budget, w) for w in _workloads(objects)) == 1, budget["metadata"]["name"]


def test_the_binder_elects_its_leader_through_the_lease_its_role_grants(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["base"]
    pod = find(objects, "Deployment", "gpushare-binder")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert args.leader_elect, "the replicated binder must elect its leader"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    role = find(objects, "Role", "gpushare-binder-lease")
    assert role["metadata"]["namespace"] == NAMESPACE
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert [r["resourceNames"] for r in named] == [[args.lease_name]]
    assert set(named[0]["verbs"]) == {"get", "update"}
    binding = find(objects, "RoleBinding", "gpushare-binder-lease")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpushare-binder", "namespace": NAMESPACE}]


def test_the_operations_guide_says_the_replicas_the_manifests_ship(rendered: dict[str, list[dict[str, Any]]]) -> None:
    text = SCALING.read_text()
    for name in sorted(REPLICATED):
        service = name.removeprefix("gpushare-")
        row = re.search(rf"^\| {service} \| `replicas` \((\d+)\)", text, re.MULTILINE)
        assert row is not None, f"docs/operations.md has no scaling row for {service}"
        shipped = find(rendered["base"], "Deployment", name)["spec"]["replicas"]
        assert int(row.group(1)) == shipped, f"{service}: the guide says {row.group(1)}, the manifests {shipped}"


# docs/operations.md's "Replicas, roles and disruption budgets" rows -> (kustomization, kind, name) they describe
ROLE_ROWS = {
    "extender": ("base", "Deployment", "gpushare-extender"),
    "binder": ("base", "Deployment", "gpushare-binder"),
    "accounting": ("base", "Deployment", "gpushare-accounting"),
    "NATS": ("base", "StatefulSet", "nats"),
    "second scheduler": ("overlays/second-scheduler", "Deployment", "gpushare-scheduler"),
}


def _budget(objects: list[dict[str, Any]], workload: dict[str, Any]) -> str:
    mine = [o for o in objects if o["kind"] == "PodDisruptionBudget" and _selects(o, workload)]
    if not mine:
        return "none"
    spec = mine[0]["spec"]
    return ", ".join(f"`{k}: {spec[k]}`" for k in ("minAvailable", "maxUnavailable") if k in spec)


def test_the_operations_guide_says_each_workloads_replicas_and_budget(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    section = SCALING.read_text().split("## Replicas, roles and disruption budgets", 1)[1].split("\n## ", 1)[0]
    rows = {
        cells[0]: cells[1:3]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| workload") and not line.startswith("|---")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for row, (kustomization, kind, name) in ROLE_ROWS.items():
        found = [cells for label, cells in rows.items() if label.split(" (")[0] == row]
        assert found, f"docs/operations.md has no row for {row}"
        replicas, budget = found[0]
        workload = find(rendered[kustomization], kind, name)
        assert replicas.split()[0] == str(workload["spec"]["replicas"]), f"{row}: {replicas}"
        assert budget == _budget(rendered[kustomization], workload), f"{row}: the guide says {budget}"
