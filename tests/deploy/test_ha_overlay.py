"""k8s/overlays/ha: PostgreSQL as a CloudNativePG Cluster, NATS as the base's three-server cluster.

The operator's CRDs cannot be had here, so the `Cluster` object cannot be validated against its schema. Instead,
every field it sets is checked against the fields of CloudNativePG's API reference for the release the overlay
names (1.28: cloudnative-pg.io/documentation/1.28/cloudnative-pg.v1/, `ClusterSpec` and the types it refers to),
written down below with the values the reference allows; a field or value outside it fails the test. The
Kubernetes objects of the overlay are validated with the rest (test_manifests.py, every kustomization).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

from shared.ledger.db import async_url
from tests.deploy.tools import K8S, MIGRATE_JOB, find, key, pod_spec

OVERLAY = "overlays/ha"
CLOUDNATIVEPG_RELEASE = "1.28"
# ClusterSpec fields of the 1.28 API reference (a subset: those an operator of gpushare is likely to set), as
# dotted paths; None: any value of the documented type, a tuple: the values the reference allows.
CLUSTER_FIELDS: dict[str, tuple[str, ...] | None] = {
    "description": None,
    "imageName": None,
    "instances": None,
    "minSyncReplicas": None,
    "maxSyncReplicas": None,
    "primaryUpdateStrategy": ("unsupervised", "supervised"),
    "primaryUpdateMethod": ("switchover", "restart"),
    "enablePDB": None,
    "failoverDelay": None,
    "switchoverDelay": None,
    "enableSuperuserAccess": None,
    "superuserSecret.name": None,
    "postgresql.parameters.*": None,
    "postgresql.pg_hba": None,
    "postgresql.synchronous.method": ("any", "first"),
    "postgresql.synchronous.number": None,
    "postgresql.synchronous.maxStandbyNamesFromCluster": None,
    "postgresql.synchronous.dataDurability": ("required", "preferred"),
    "postgresql.synchronous.failoverQuorum": None,
    "bootstrap.initdb.database": None,
    "bootstrap.initdb.owner": None,
    "bootstrap.initdb.secret.name": None,
    "bootstrap.initdb.encoding": None,
    "bootstrap.initdb.dataChecksums": None,
    "bootstrap.initdb.postInitSQL": None,
    "bootstrap.initdb.postInitApplicationSQL": None,
    "storage.size": None,
    "storage.storageClass": None,
    "walStorage.size": None,
    "walStorage.storageClass": None,
    "affinity.enablePodAntiAffinity": None,
    "affinity.podAntiAffinityType": ("preferred", "required"),
    "affinity.topologyKey": None,
    "affinity.nodeSelector.*": None,
    "resources.requests.*": None,
    "resources.limits.*": None,
    "inheritedMetadata.labels.*": None,
    "inheritedMetadata.annotations.*": None,
    "monitoring.enablePodMonitor": None,
}


def _leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf; a map the reference leaves free (`x.*`) ends the path at `x.*`."""
    if isinstance(value, dict):
        if f"{path}.*" in CLUSTER_FIELDS:
            return [(f"{path}.*", v) for v in value.values()]
        out = []
        for k, v in value.items():
            out += _leaves(v, f"{path}.{k}" if path else k)
        return out
    return [(path, value)]


def undocumented(spec: dict[str, Any]) -> list[str]:
    """What `spec` sets that CloudNativePG's API reference does not document (a field, or a value of it)."""
    problems = []
    for path, value in _leaves(spec):
        if path not in CLUSTER_FIELDS:
            problems.append(f"spec.{path} is not a field of CloudNativePG {CLOUDNATIVEPG_RELEASE}'s ClusterSpec")
        elif (allowed := CLUSTER_FIELDS[path]) is not None and value not in allowed:
            problems.append(f"spec.{path}: {value!r} is not one of {allowed}")
    return problems


@pytest.fixture
def objects(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered[OVERLAY]


def test_the_cluster_uses_only_documented_fields_of_the_named_release(objects: list[dict[str, Any]]) -> None:
    cluster = find(objects, "Cluster", "gpushare-db")
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    assert undocumented(cluster["spec"]) == []
    assert f"documentation/{CLOUDNATIVEPG_RELEASE}/" in (K8S / OVERLAY / "kustomization.yaml").read_text()
    # the check sees a misspelt field and a value the reference does not allow
    broken = {**cluster["spec"], "postgresql": {"synchronous": {"methd": "any", "dataDurability": "strict"}}}
    assert undocumented(broken) == [
        f"spec.postgresql.synchronous.methd is not a field of CloudNativePG {CLOUDNATIVEPG_RELEASE}'s ClusterSpec",
        "spec.postgresql.synchronous.dataDurability: 'strict' is not one of ('required', 'preferred')",
    ]


def test_three_instances_on_three_nodes_with_synchronous_replication_and_disruption_budgets(
    objects: list[dict[str, Any]],
) -> None:
    spec = find(objects, "Cluster", "gpushare-db")["spec"]
    assert spec["instances"] == 3
    sync = spec["postgresql"]["synchronous"]
    # a commit waits for one of the two standbys: none lost in a failover, none blocked by losing one instance
    assert (sync["method"], sync["number"], sync["dataDurability"]) == ("any", 1, "required")
    assert sync["number"] <= spec["instances"] - 2, "with one standby lost, the others still make the quorum"
    assert spec["enablePDB"] is True
    assert (spec["affinity"]["enablePodAntiAffinity"], spec["affinity"]["podAntiAffinityType"]) == (True, "required")
    assert spec["bootstrap"]["initdb"]["owner"] == "gpushare_migrate"
    assert spec["bootstrap"]["initdb"]["database"] == "gpushare"
    assert "ALTER ROLE gpushare_migrate CREATEROLE" in spec["bootstrap"]["initdb"]["postInitApplicationSQL"]
    assert spec["imageName"].rsplit(":", 1)[1].count(".") >= 1, "a PostgreSQL minor release, not a moving major"


def test_the_services_reach_the_primary_through_the_operators_read_write_service(
    objects: list[dict[str, Any]], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    assert {("StatefulSet", "postgres"), ("Service", "postgres")} <= {key(o) for o in rendered["base"]}
    assert not {("StatefulSet", "postgres"), ("Service", "postgres"), ("NetworkPolicy", "postgres")} & {
        key(o) for o in objects
    }
    server = find(objects, "ConfigMap", "gpushare-config")["data"]["GPUSHARE_DATABASE_SERVER"]
    url = f"postgresql://gpushare_binder@{server}"
    assert urlsplit(url).hostname == "gpushare-db-rw"
    assert dict(parse_qsl(urlsplit(url).query))["target_session_attrs"] == "read-write"
    assert "target_session_attrs=read-write" in async_url(url)
    job = pod_spec(find(objects, "Job", MIGRATE_JOB))["containers"][0]
    env = {e["name"]: e for e in job["env"]}
    owner = env["GPUSHARE_DATABASE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert owner == {"name": "gpushare-db-app", "key": "password"}, "the password the operator generated"
    assert env["GPUSHARE_DB_PASSWORD_BINDER"]["valueFrom"]["secretKeyRef"]["name"] == "gpushare-database"


def test_the_network_policy_admits_gpushare_the_instances_and_the_operator(objects: list[dict[str, Any]]) -> None:
    policy = find(objects, "NetworkPolicy", "gpushare-db")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"cnpg.io/cluster": "gpushare-db"}}
    rules = [
        ([tuple(sorted(src.items())) for src in rule["from"]], sorted(p["port"] for p in rule["ports"]))
        for rule in policy["ingress"]
    ]
    gpushare = ("podSelector", {"matchLabels": {"app.kubernetes.io/part-of": "gpushare"}})
    peers = ("podSelector", {"matchLabels": {"cnpg.io/cluster": "gpushare-db"}})
    operator = ("namespaceSelector", {"matchLabels": {"kubernetes.io/metadata.name": "cnpg-system"}})
    assert ([(gpushare,)], [5432]) in rules
    assert ([(peers,), (operator,)], [5432, 8000]) in rules


def test_nats_stays_the_three_server_cluster_every_client_knows(objects: list[dict[str, Any]]) -> None:
    assert find(objects, "StatefulSet", "nats")["spec"]["replicas"] == 3
    data = find(objects, "ConfigMap", "gpushare-config")["data"]
    assert len(data["GPUSHARE_NATS_URL"].split(",")) == 3
    assert data["GPUSHARE_STREAM_REPLICAS"] == "3"
    assert find(objects, "PodDisruptionBudget", "nats")["spec"]["maxUnavailable"] == 1
