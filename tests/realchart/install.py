"""What the real-chart tier sets up around `helm install`: the images, the storage a node without a provisioner
offers, the single-machine values, a build with the next schema revision, and a record of pods and Jobs over time.

The storage is what an administrator of a one-machine cluster provides: a StorageClass with no provisioner and one
hostPath PersistentVolume per claim the chart makes (PostgreSQL's and NATS' data), each folder owned by the uid
its server runs as (a hostPath volume gets no fsGroup).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from devstack.cluster.helm import ensure_helm
from devstack.images import BuiltImage, build_gpushare_image
from devstack.images.gpushare_image import ROOT, copy_context
from shared.kube.watching import SYNCED, watch_objects
from shared.ledger.migrate import head_revision

CHART = ROOT / "charts" / "gpushare"
SINGLE_MACHINE = CHART / "values-single-machine.yaml"
RELEASE = "gpushare"
NAMESPACE = "gpushare-system"
STORAGE_CLASS = "gpushare-local"
SERVERS = ("postgres", "nats", "natsMonitor", "extender", "binder", "accounting", "nodeAgent")
# The test-only revision the upgrade brings: added on top of the shipped head in a copy of the sources, never in
# migrations/. Additive (a new table), with the default services_from (the revision before it), so the services of
# the build before keep running on the schema it leaves until they are replaced.
NEXT_REVISION = "9001_realchart_next"
NEXT_TABLE = "realchart_upgrade_probe"


def next_revision_source(dest: Path) -> Path:
    """The Dockerfile's context of this checkout in `dest`, with one more migration on top of its head."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "Dockerfile").write_text((ROOT / "Dockerfile").read_text())
    copy_context(ROOT, dest)
    (dest / "migrations" / "versions" / f"{NEXT_REVISION}.py").write_text(
        f'"""A test-only revision (tests/realchart): the schema one migration newer than the shipped head.\n\n'
        f"Revision ID: {NEXT_REVISION}\nRevises: {head_revision()}\n"
        f'"""\n\nimport sqlalchemy as sa\nfrom alembic import op\n\n'
        f'revision = "{NEXT_REVISION}"\ndown_revision = "{head_revision()}"\nbranch_labels = None\n'
        f"depends_on = None\n\n\ndef upgrade() -> None:\n"
        f'    op.create_table("{NEXT_TABLE}", sa.Column("id", sa.Integer(), primary_key=True))\n\n\n'
        f'def downgrade() -> None:\n    op.drop_table("{NEXT_TABLE}")\n'
    )
    return dest


def build_next_image(work: Path) -> BuiltImage:
    """The gpushare image of this checkout plus the test-only revision (cached by content like any build)."""
    return build_gpushare_image(next_revision_source(work / "next-source"))


def storage(folder: Path) -> list[dict[str, Any]]:
    """A StorageClass without a provisioner and a hostPath PersistentVolume for each of the chart's claims
    (PostgreSQL runs as uid 999, NATS as 1000), its folder made under `folder` and owned by that uid. Each volume is
    bound to its claim beforehand (`claimRef`): the two are alike, and left to the binder a claim took the other
    server's folder about one run in two ("Permission denied" from initdb and nats-server)."""
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "Immediate",
        }
    ]
    for name, uid in (("postgres", 999), ("nats", 1000)):
        path = folder / name
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, uid)
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"gpushare-{name}"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": STORAGE_CLASS,
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(path), "type": "Directory"},
                    "claimRef": {"namespace": NAMESPACE, "name": f"data-{name}-0"},  # the StatefulSet's claim
                },
            }
        )
    return objects


def values(
    *,
    node: str,
    kubelet_root: Path,
    api_port: int,
    ports: dict[str, int],
    gpushare: BuiltImage,
    postgres: BuiltImage,
    nats: BuiltImage,
    fake_gpus: str,
) -> dict[str, Any]:
    """The values of this machine's install, beside values-single-machine.yaml: the one node, free ports, the
    local images (never pulled: there is no registry), the storage class, kubelet's folder, fake GPUs."""
    repository, tag = gpushare.name.rsplit(":", 1)
    return {
        "singleMachine": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "ports": ports,
            "apiServer": {"port": api_port},
        },
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "postgresql": {"image": postgres.name, "storageClassName": STORAGE_CLASS, "storage": "1Gi"},
        "nats": {"image": nats.name, "storageClassName": STORAGE_CLASS, "storage": "1Gi"},
        "nodeAgent": {"kubeletRootDir": str(kubelet_root), "extraArgs": ["--fake-gpus", fake_gpus]},
    }


def image_values(image: BuiltImage) -> list[str]:
    """`--set` flags naming another gpushare image."""
    repository, tag = image.name.rsplit(":", 1)
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}"]


@dataclass
class Helm:
    """`helm` against one control plane, timing each command."""

    kubeconfig: Path
    binary: str = field(default_factory=lambda: str(ensure_helm()))
    seconds: dict[str, float] = field(default_factory=dict)

    async def __call__(self, step: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = [self.binary, *args, "--kubeconfig", str(self.kubeconfig)]
        started = time.monotonic()
        proc = await asyncio.to_thread(
            subprocess.run, cmd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        self.seconds[step] = time.monotonic() - started
        return proc


def _sighting(kind: str, namespace: str, obj: dict[str, Any]) -> Sighting:
    """A pod or Job (as the API server sent it) as a sighting now; times as the API server writes them."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    name, uid, created = f"{namespace}/{meta.get('name')}", str(meta.get("uid")), str(meta.get("creationTimestamp"))
    if kind == "Pod":
        image = str(((spec.get("containers") or [{}])[0]).get("image") or "")
        return Sighting(time.time(), kind, name, uid, created, str(status.get("phase") or ""), image)
    done = str(status.get("completionTime") or "")
    return Sighting(time.time(), kind, name, uid, created, "Complete" if done else "Running", "", done)


def helm_errors(stderr: str) -> str:
    """helm's stderr without its notes about the chart's symbolic links and server-side warnings."""
    noise = ("found symbolic link in path", "would violate PodSecurity")
    return "\n".join(line for line in stderr.splitlines() if not any(n in line for n in noise))


@dataclass
class Sighting:
    """A pod or Job as the recorder saw it at one moment."""

    at: float
    kind: str
    name: str
    uid: str
    created: str
    phase: str
    image: str = ""
    finished: str = ""


class Recorder:
    """Watches the namespaces' pods and Jobs while it runs: every state each one passed through, from when, in
    what phase. A watch reports every change, so a hook Job that Helm deletes a moment after it completed is seen
    complete (a list every 0.5 s, as before, could miss those moments on a loaded machine: CI saw the upgrade's
    migration Job only running)."""

    def __init__(self, api: client.ApiClient, namespaces: Sequence[str]) -> None:
        core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
        self.sources = [
            (kind, fn, ns)
            for ns in namespaces
            for kind, fn in (("Pod", core.list_namespaced_pod), ("Job", batch.list_namespaced_job))
        ]
        self.sightings: list[Sighting] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def _follow(self, kind: str, list_fn: Any, namespace: str, listed: asyncio.Event) -> None:
        async for event in watch_objects(list_fn, namespace=namespace, what=f"{kind}s of {namespace}"):
            if event.type == SYNCED:
                listed.set()
            else:
                self.sightings.append(_sighting(kind, namespace, event.object))

    async def start(self, timeout_s: float = 60) -> None:
        """Start watching; returns once every namespace's pods and Jobs were listed."""
        listed = [asyncio.Event() for _ in self.sources]
        self._tasks = [
            asyncio.create_task(self._follow(kind, fn, ns, done))
            for (kind, fn, ns), done in zip(self.sources, listed, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in listed)), timeout_s)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def latest(self) -> dict[str, Sighting]:
        """The last sighting of every object (by uid)."""
        out: dict[str, Sighting] = {}
        for s in self.sightings:
            out[s.uid] = s
        return out

    def to_json(self) -> str:
        return json.dumps([s.__dict__ for s in self.latest().values()], indent=1)
