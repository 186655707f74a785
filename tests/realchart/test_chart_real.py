"""The chart for real: `helm install` of charts/gpushare, single-machine values, into the local control plane with
two real nodes on this machine (kubelet v1.37.2, containerd, runc each), the install on one of them (the other,
labelled for the node agent too, shows it stays off), every part a pod of an image built here without a container engine
(devstack/images: gpushare's, PostgreSQL's, NATS'), imported with `ctr images import`; `helm test`; a GPU pod placed
by the real kube-scheduler calling the extender in its pod; `helm upgrade` to a build with the next schema revision.

One scenario runs once for the module (`scenario`), recording what it saw at each step; each test checks one
promise against that record, so the tests hold in any order:

1. install: PostgreSQL, NATS, extender, binder, accounting and the node agent's DaemonSet all Running and ready
   on the one node, the migration Job complete, every server listening on 127.0.0.1 only (nothing beyond
   loopback);
2. `helm test` passes (each service's /readyz, NATS' JetStream health, `gpushare inspect` through accounting);
3. a pod asking 4 GiB of `aliyun.com/gpu-mem` runs, and the environment its container printed is its ledger share
   (read through accounting's pod);
4. `helm upgrade` to a build whose only change is a test-only migration on top of the head: the pre-upgrade Job
   runs it to completion before any new pod of the services is created, the schema is then at that revision,
   the pod placed before keeps running (same pod, no restart) and keeps its ledger share, PostgreSQL's pod is the
   same one, and a pod placed after the upgrade gets its exact share from the new build.

The measurements (image builds, sizes, import, install to all-ready, `helm test`, upgrade) are printed at the end,
never asserted (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml
from kubernetes_asyncio import client

from devstack.cluster import ControlPlane
from devstack.cluster.buildtools import ControlPlaneUnavailable
from devstack.cluster.controlplane import ExtenderConfig
from devstack.cluster.realnode import RealNode
from devstack.embedded import free_port
from devstack.images import BuiltImage, build_gpushare_image
from devstack.images.servers import build_nats_image, build_postgres_image
from tests.realchart import install as i
from tests.realnode import helpers as r
from tests.realnode.conftest import real_nodes_unavailable
from tests.realnode.test_containers import assert_received
from tests.system_tools import listening_addresses
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

NODE = "gpu-node-1"
# A second real node on the same machine, labelled for the node agent too: the install stays off it
# (singleMachine.nodeSelector), or its host-network pods would want the same ports twice.
OTHER_NODE = "gpu-node-2"
FAKE_GPUS = "2x16GiB:Tesla-T4"
WORK = "gpu-work"
EXTENDER_PATH = "/gpushare-scheduler"


@dataclass
class Placed:
    """A GPU pod as seen at one moment: its identity, state, what its container printed, its ledger record."""

    uid: str
    phase: str
    restarts: int
    env: dict[str, str]
    allocation: dict[str, Any]


@dataclass
class Scenario:
    """What the scenario saw (see the module docstring)."""

    ports: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    images: dict[str, BuiltImage] = field(default_factory=dict)
    install: Any = None
    installed_pods: list[dict[str, Any]] = field(default_factory=list)
    installed_jobs: set[str] = field(default_factory=set)
    listening: dict[str, set[str]] = field(default_factory=dict)
    helm_test: Any = None
    before: Placed | None = None
    postgres_uid_before: str = ""
    upgrade: Any = None
    sightings: list[i.Sighting] = field(default_factory=list)
    upgraded_at: float = 0.0
    before_after_upgrade: Placed | None = None
    postgres_uid_after: str = ""
    schema_revision: str = ""
    after: Placed | None = None
    upgraded_images: dict[str, str] = field(default_factory=dict)
    charged_after: dict[str, int] = field(default_factory=dict)
    other_node_gpu_mem: str = "-"
    diagnosis: str = ""  # the pods' states, logs and warnings when helm install or upgrade failed
    kept: str = ""  # the scenario's folder, kept with every log when it stopped short


def _built(build: Any, *args: Any) -> tuple[BuiltImage, float]:
    started = time.monotonic()
    try:
        image = build(*args)
    except ControlPlaneUnavailable as exc:
        real_nodes_unavailable(f"the images cannot be built: {exc.reason}")
        raise
    return image, time.monotonic() - started


async def _placed(api: client.ApiClient, accounting: str, name: str) -> Placed:
    """The GPU pod `name` once Running, what it printed and its assigned ledger record (through accounting)."""
    pod = await r.wait_running(api, WORK, name, timeout_s=120)
    env = await r.printed_env(api, WORK, name, "main")

    async def assigned() -> dict[str, Any] | None:
        async with httpx.AsyncClient(base_url=accounting, timeout=10) as http:
            answer = await http.get(f"/v1/pods/{WORK}/{name}")
        if answer.status_code != 200:
            return None
        allocation: dict[str, Any] | None = answer.json().get("allocation")
        return allocation if allocation and allocation["state"] == "assigned" else None

    allocation = await eventually(assigned, what=f"{WORK}/{name} assigned in the ledger", within=60, interval=0.3)
    restarts = sum(c.restart_count for c in pod.status.container_statuses or [])
    return Placed(pod.metadata.uid, pod.status.phase, restarts, env, allocation)


async def _gpu_pod(api: client.ApiClient, name: str, image: str, gib: int) -> None:
    body = r.pod(name, [r.container("main", image, mem=gib)], automountServiceAccountToken=False)
    await client.CoreV1Api(api).create_namespaced_pod(WORK, body)


async def _pods(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    listed = await client.CoreV1Api(api).list_namespaced_pod(namespace)
    return [api.sanitize_for_serialization(p) for p in listed.items]


async def _schema_revision(api: client.ApiClient, port: int) -> str:
    """alembic's revision in the ledger, asked of PostgreSQL's pod as the schema's owner."""
    secret = await client.CoreV1Api(api).read_namespaced_secret("gpushare-database", i.NAMESPACE)
    password = base64.b64decode(secret.data["migrate-password"]).decode()
    conn = await asyncpg.connect(
        host="127.0.0.1", port=port, user="gpushare_migrate", password=password, database="gpushare"
    )
    try:
        return str(await conn.fetchval("SELECT version_num FROM alembic_version"))
    finally:
        await conn.close()


def _report(s: Scenario) -> str:
    lines = ["real chart tier (two real nodes on one machine, the install on one; kubelet v1.37.2):"]
    for name, image in s.images.items():
        lines.append(
            f"  image {name:9} {image.name}: {image.layer_bytes / 2**20:6.1f} MiB compressed in "
            f"{len(image.layers)} layers, build {s.seconds.get('build ' + name, 0):5.1f} s "
            f"({'cached' if image.cached else 'built'})"
        )
    for step in ("import", "import next", "install to all-ready", "helm test", "upgrade to all-ready"):
        if step in s.seconds:
            lines.append(f"  {step:22} {s.seconds[step]:6.1f} s")
    if s.kept:
        lines.append(f"  stopped short: logs kept in {s.kept}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
async def scenario(real_node_reason: str) -> AsyncIterator[Scenario]:
    if real_node_reason:
        real_nodes_unavailable(real_node_reason)
    # not under pytest's numbered folders, which another pytest run may prune while this one runs
    work = Path(tempfile.mkdtemp(prefix="gpushare-realchart-"))
    s = Scenario(ports={name: free_port() for name in i.SERVERS})
    for name, build in (
        ("gpushare", build_gpushare_image),
        ("postgres", build_postgres_image),
        ("nats", build_nats_image),
    ):
        s.images[name], s.seconds[f"build {name}"] = await asyncio.to_thread(_built, build)
    extender = ExtenderConfig(url_prefix=f"http://127.0.0.1:{s.ports['extender']}{EXTENDER_PATH}")
    cp = ControlPlane(extender, service_account_tokens=True, work_dir=work / "cluster")
    nodes: list[RealNode] = []
    try:
        await asyncio.to_thread(cp.start)
        node = RealNode(NODE, cp, labels={"gpushare": "true"}, log_dir=work / "logs")
        other = RealNode(OTHER_NODE, cp, labels={"gpushare": "true"}, log_dir=work / "logs")
        nodes = [node, other]
        started = await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        assert node.containerd is not None
        started = time.monotonic()
        for image in s.images.values():
            await asyncio.to_thread(node.containerd.ctr, "images", "import", "--local", str(image.archive))
        s.seconds["import"] = time.monotonic() - started
        api = cp.api_client()
        try:
            await _run(s, cp, node, api, work)
        finally:
            await api.close()
        yield s
    finally:
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in nodes))
        await asyncio.to_thread(cp.stop)
        if s.after is not None:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the scenario stopped short: keep kubelet's, containerd's and the control plane's logs
            s.kept = str(work)
        print("\n" + _report(s), file=sys.stderr)


async def _run(s: Scenario, cp: ControlPlane, node: RealNode, api: client.ApiClient, work: Path) -> None:
    core = client.CoreV1Api(api)
    storage = i.storage(node.folder / "volumes")  # removed with the node
    await client.StorageV1Api(api).create_storage_class(storage[0])
    for pv in storage[1:]:
        await core.create_persistent_volume(pv)
    values = work / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            i.values(
                node=NODE,
                kubelet_root=node.root_dir,
                api_port=int(cp.server_url.rsplit(":", 1)[1]),
                ports=s.ports,
                gpushare=s.images["gpushare"],
                postgres=s.images["postgres"],
                nats=s.images["nats"],
                fake_gpus=FAKE_GPUS,
            )
        )
    )
    helm = i.Helm(cp.kubeconfig_path)
    wait = ["--wait", "--wait-for-jobs", "--timeout", "5m"]
    common = ["-n", i.NAMESPACE, "-f", str(i.SINGLE_MACHINE), "-f", str(values), *wait]
    s.install = await helm("install to all-ready", "install", i.RELEASE, str(i.CHART), "--create-namespace", *common)
    s.seconds.update(helm.seconds)
    if s.install.returncode != 0:
        s.diagnosis = await _diagnosis(api)
        return
    s.installed_pods = await _pods(api, i.NAMESPACE)
    s.installed_jobs = {j.metadata.uid for j in (await client.BatchV1Api(api).list_namespaced_job(i.NAMESPACE)).items}
    s.listening = {name: listening_addresses(port) for name, port in s.ports.items()}
    other = await core.read_node(OTHER_NODE)
    s.other_node_gpu_mem = (other.status.allocatable or {}).get("aliyun.com/gpu-mem", "")
    s.helm_test = await helm("helm test", "test", i.RELEASE, "-n", i.NAMESPACE, "--logs", "--timeout", "3m")
    s.seconds.update(helm.seconds)

    await core.create_namespace({"metadata": {"name": WORK}})
    await eventually(lambda: _has_default_account(core), what=f"the default ServiceAccount of {WORK}", within=60)
    accounting = f"http://127.0.0.1:{s.ports['accounting']}"
    await _gpu_pod(api, "before", node.workload_image, 4)
    s.before = await _placed(api, accounting, "before")
    postgres = await core.read_namespaced_pod("postgres-0", i.NAMESPACE)
    s.postgres_uid_before = postgres.metadata.uid

    s.images["next"], s.seconds["build next"] = await asyncio.to_thread(_built, i.build_next_image, work)
    assert node.containerd is not None
    started = time.monotonic()
    await asyncio.to_thread(node.containerd.ctr, "images", "import", "--local", str(s.images["next"].archive))
    s.seconds["import next"] = time.monotonic() - started
    recorder = i.Recorder(api, [i.NAMESPACE, WORK])
    await recorder.start()
    try:
        s.upgrade = await helm(
            "upgrade to all-ready", "upgrade", i.RELEASE, str(i.CHART), *common, *i.image_values(s.images["next"])
        )
    finally:
        await recorder.stop()
    s.upgraded_at = time.time()
    s.sightings = list(recorder.latest().values())
    s.seconds.update(helm.seconds)
    if s.upgrade.returncode != 0:
        s.diagnosis = await _diagnosis(api)
        return
    s.upgraded_images = {
        p["metadata"]["name"]: p["spec"]["containers"][0]["image"] for p in await _pods(api, i.NAMESPACE)
    }
    s.schema_revision = await _schema_revision(api, s.ports["postgres"])
    s.before_after_upgrade = await _placed(api, accounting, "before")
    s.postgres_uid_after = (await core.read_namespaced_pod("postgres-0", i.NAMESPACE)).metadata.uid
    await _gpu_pod(api, "after", node.workload_image, 8)
    s.after = await _placed(api, accounting, "after")
    async with httpx.AsyncClient(base_url=accounting, timeout=10) as http:
        listed = await http.get("/v1/allocations", params={"namespace": WORK, "state": "assigned"})
    s.charged_after = {a["pod_name"]: a["memory_mib"] for a in listed.json()["items"]}


async def _diagnosis(api: client.ApiClient) -> str:
    """What the chart's pods are doing: each pod's phase, containers' states and restarts, its last log lines, and
    the namespace's warning events (a failed install or upgrade says why)."""
    core = client.CoreV1Api(api)
    lines = []
    for pod in (await core.list_namespaced_pod(i.NAMESPACE)).items:
        states = [
            f"{c.name}: ready={c.ready} restarts={c.restart_count} {api.sanitize_for_serialization(c.state)}"
            for c in pod.status.container_statuses or []
        ]
        lines.append(f"{pod.metadata.name} {pod.status.phase} {'; '.join(states)}")
        try:
            log = await core.read_namespaced_pod_log(pod.metadata.name, i.NAMESPACE, tail_lines=5)
        except client.exceptions.ApiException as exc:
            log = f"(no log: {exc.status})"
        lines += [f"    {line[:300]}" for line in str(log).splitlines()]
    events = await core.list_namespaced_event(i.NAMESPACE)
    lines += [f"event {e.involved_object.name}: {e.reason}: {e.message}" for e in events.items if e.type == "Warning"]
    return "\n".join(lines)


async def _has_default_account(core: client.CoreV1Api) -> bool:
    accounts = await core.list_namespaced_service_account(WORK)
    return any(a.metadata.name == "default" for a in accounts.items)


def _installed(s: Scenario) -> None:
    assert s.install is not None and s.install.returncode == 0, (
        f"helm install failed:\n{i.helm_errors(s.install.stderr)}\n{s.diagnosis}"
    )


def test_every_part_runs_as_a_pod_of_the_local_images(scenario: Scenario) -> None:
    _installed(scenario)
    by_app: dict[str, list[dict[str, Any]]] = {}
    for pod in scenario.installed_pods:
        by_app.setdefault(pod["metadata"]["labels"]["app.kubernetes.io/name"], []).append(pod)
    servers = {"postgres", "nats", "gpushare-extender", "gpushare-binder", "gpushare-accounting", "gpushare-node-agent"}
    assert servers <= set(by_app), sorted(by_app)
    for app in servers:
        (pod,) = by_app[app]
        assert pod["spec"]["nodeName"] == NODE and pod["spec"]["hostNetwork"] is True, app
        assert pod["status"]["phase"] == "Running", (app, pod["status"])
        assert all(c["ready"] for c in pod["status"]["containerStatuses"]), (app, pod["status"]["containerStatuses"])
    images = {pod["spec"]["containers"][0]["image"] for app in servers for pod in by_app[app]}
    assert images == {scenario.images[n].name for n in ("gpushare", "postgres", "nats")}
    (migration,) = by_app["gpushare-migrate"]
    assert migration["status"]["phase"] == "Succeeded"


def test_the_install_stays_on_its_one_node_of_the_machine(scenario: Scenario) -> None:
    """Both real nodes are labelled gpushare=true; only the one singleMachine.nodeSelector names runs gpushare (the
    node agent's DaemonSet included), so no port of the machine is wanted twice."""
    _installed(scenario)
    assert {p["spec"].get("nodeName") for p in scenario.installed_pods} == {NODE}
    assert scenario.other_node_gpu_mem in ("", "0"), "the other node has no node agent, so no GPU capacity"


def test_every_server_listens_on_loopback_only(scenario: Scenario) -> None:
    _installed(scenario)
    assert scenario.listening == {name: {"127.0.0.1"} for name in i.SERVERS}


def test_helm_test_passes(scenario: Scenario) -> None:
    _installed(scenario)
    proc = scenario.helm_test
    assert proc is not None and proc.returncode == 0, f"{proc.stdout}\n{i.helm_errors(proc.stderr)}"
    for check in ("extender", "binder", "accounting", "nats"):
        assert (
            f"ok      {check}: http://127.0.0.1:{scenario.ports['natsMonitor' if check == 'nats' else check]}/"
            in proc.stdout
        )
    assert f"{NODE}  127.0.0.1" in proc.stdout, "gpushare inspect lists the node through accounting"


def test_a_gpu_pod_placed_through_the_extender_pod_gets_its_ledger_share(scenario: Scenario) -> None:
    _installed(scenario)
    placed = scenario.before
    assert placed is not None and placed.allocation["node"] == NODE
    assert_received(placed.env, placed.allocation["parts"], 4)
    assert placed.allocation["memory_mib"] == 4096


def _upgraded(s: Scenario) -> None:
    _installed(s)
    assert s.upgrade is not None and s.upgrade.returncode == 0, (
        f"helm upgrade failed:\n{i.helm_errors(s.upgrade.stderr)}\n{s.diagnosis}"
    )


def test_the_upgrade_migrates_before_any_new_service_pod_starts(scenario: Scenario) -> None:
    _upgraded(scenario)
    assert scenario.schema_revision == i.NEXT_REVISION
    installed = {p["metadata"]["uid"] for p in scenario.installed_pods}
    hooks = [x for x in scenario.sightings if x.kind == "Job" and x.uid not in scenario.installed_jobs]
    completed = [x for x in hooks if x.phase == "Complete" and "gpushare-migrate-" in x.name]
    assert completed, f"no migration Job of the upgrade was seen to complete: {hooks}"
    migrated_at = min(x.finished for x in completed)
    new = [
        x
        for x in scenario.sightings
        if x.kind == "Pod"
        and x.name.startswith(f"{i.NAMESPACE}/gpushare-")
        and not any(other in x.name for other in ("-migrate-", "-test-"))  # the hook itself, helm test's pods
        and x.uid not in installed
    ]
    assert new, "the upgrade replaced no service pod"
    early = [x.name for x in new if x.created < migrated_at]
    assert not early, f"created before the migration finished at {migrated_at}: {early}"
    next_image = scenario.images["next"].name
    for name in ("gpushare-extender", "gpushare-binder", "gpushare-accounting", "gpushare-node-agent"):
        assert [img for pod, img in scenario.upgraded_images.items() if pod.startswith(name)] == [next_image], name


def test_no_pod_is_lost_and_the_share_placed_before_is_kept(scenario: Scenario) -> None:
    _upgraded(scenario)
    before, kept = scenario.before, scenario.before_after_upgrade
    assert before is not None and kept is not None
    assert (kept.uid, kept.phase, kept.restarts) == (before.uid, "Running", 0)
    assert kept.allocation["id"] == before.allocation["id"] and kept.allocation["parts"] == before.allocation["parts"]
    assert kept.env == before.env
    assert scenario.postgres_uid_after == scenario.postgres_uid_before, "PostgreSQL's pod was replaced"
    gone = {
        x.name for x in scenario.sightings if x.kind == "Pod" and x.name.startswith(f"{WORK}/") and x.phase != "Running"
    }
    assert not gone, f"workload pods not running during the upgrade: {gone}"


def test_a_pod_placed_after_the_upgrade_gets_its_exact_share(scenario: Scenario) -> None:
    _upgraded(scenario)
    after = scenario.after
    assert after is not None and after.allocation["node"] == NODE
    assert_received(after.env, after.allocation["parts"], 8)
    # both shares charged, each once: the one placed before the upgrade and this one
    assert scenario.charged_after == {"before": 4096, "after": 8192}
