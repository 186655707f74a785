"""The `gpushare-annotations` ValidatingAdmissionPolicy shipped in k8s/base, on the real current kube-apiserver.

Only gpushare's own accounts (the binder's and node agent's ServiceAccounts), Aliyun gpushare's during a
migration, and system:masters write gpushare's allocation annotations (`ALIYUN_COM_GPU_MEM_*`,
`gpushare.io/allocation`): an ordinary user can neither create a pod or a Binding that carries them nor add,
change or remove them later, while the binder, running as its ServiceAccount, binds and annotates as always.
The local apiserver authorizes everything (AlwaysAllow), but admission policies run for every request; the
identities are taken by impersonation (`Impersonate-User`), as kubectl's `--as` does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster import ControlPlane
from shared.annotations import ALLOCATION, GPU_MEM_ASSIGNED, GPU_MEM_IDX, GPU_MEM_POD, GPU_MODEL_INCLUDE
from shared.kube.binding import binding_body
from tests.binder.conftest import SCHEDULER_NONE, request_for, state_becomes

pytestmark = pytest.mark.e2e

POLICY_FILE = Path(__file__).resolve().parents[2] / "k8s" / "base" / "annotation-policy.yaml"
BINDER = "system:serviceaccount:gpushare-system:gpushare-binder"
OLD_EXTENDER = "system:serviceaccount:kube-system:gpushare-schd-extender"
USER = "mallory"  # an ordinary authenticated user


@pytest.fixture
async def policy(kube: ApiClient) -> AsyncIterator[None]:
    """The shipped policy and its binding, in force (removed afterwards)."""
    admission = client.AdmissionregistrationV1Api(kube)
    body, binding = list(yaml.safe_load_all(POLICY_FILE.read_text()))
    await admission.create_validating_admission_policy(body)
    await admission.create_validating_admission_policy_binding(binding)
    try:
        yield
    finally:
        await admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        await admission.delete_validating_admission_policy(body["metadata"]["name"])


@pytest.fixture
async def acting(control_plane: ControlPlane) -> AsyncIterator[Callable[[str], ApiClient]]:
    """API clients that act as another user (closed afterwards)."""
    made: list[ApiClient] = []

    def as_user(name: str) -> ApiClient:
        api = control_plane.api_client()
        api.set_default_header("Impersonate-User", name)
        made.append(api)
        return api

    yield as_user
    for api in made:
        await api.close()


def pod_body(name: str, annotations: dict[str, str] | None = None, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER_NONE,
        "containers": [
            {
                "name": "main",
                "image": "busybox:1.36",
                "resources": {"limits": {"aliyun.com/gpu-mem": "2"}},
            }
        ],
    }
    if node:
        spec["nodeName"] = node
    meta = {"name": name, "annotations": annotations or {}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


async def refusal(call: Awaitable[object]) -> str | None:
    """The apiserver's refusal message for `call`, or None when it was admitted."""
    try:
        await call
    except ApiException as exc:
        assert exc.status == 403, exc.body
        return str(json.loads(exc.body)["message"])
    return None


def annotate(name: str, values: dict[str, str | None]) -> dict[str, Any]:
    return {"metadata": {"annotations": values}}


async def test_only_gpushares_accounts_write_its_annotations(
    policy, acting, cluster, ledger, engine, start_binder
) -> None:
    mallory = client.CoreV1Api(acting(USER))
    ns = cluster.namespace
    node = await cluster.node(ledger)

    async def create(body: dict[str, Any]) -> str | None:
        cluster.pods.append(body["metadata"]["name"])
        return await refusal(mallory.create_namespaced_pod(ns, body))

    # enforcement is eventually consistent (the apiserver compiles the policy from its informer): probe until
    # the first refusal, within a bound
    hostile = {GPU_MEM_IDX: "0", GPU_MEM_POD: "16", GPU_MEM_ASSIGNED: "true"}
    deadline = time.monotonic() + 60
    while (message := await create(pod_body(f"probe-{uuid.uuid4().hex[:6]}", hostile, node.name))) is None:
        assert time.monotonic() < deadline, "the policy was never enforced"
        await asyncio.sleep(0.5)
    assert "ValidatingAdmissionPolicy 'gpushare-annotations'" in message, message
    assert all(key in message.split("writes the annotations ")[1] for key in hostile), message
    assert "request aliyun.com/gpu-mem in the pod" in message, message
    record = json.dumps({"id": str(uuid.uuid4()), "node": node.name, "parts": []})
    assert "gpushare.io/allocation" in (await create(pod_body("own-record", {ALLOCATION: record})) or "")

    # an ordinary GPU pod (scheduling hints are the user's to write) is admitted; adding a record to it is not
    assert await create(pod_body("plain", {GPU_MODEL_INCLUDE: "Tesla-V100"})) is None
    message = await refusal(mallory.patch_namespaced_pod("plain", ns, annotate("plain", {ALLOCATION: record})))
    assert message and "gpushare.io/allocation" in message, message
    # ... nor through the status subresource, nor in a Binding of the user's making
    message = await refusal(mallory.patch_namespaced_pod_status("plain", ns, annotate("plain", {GPU_MEM_IDX: "0"})))
    assert message and "ALIYUN_COM_GPU_MEM_IDX" in message, message
    binding = binding_body(ns, "plain", node.name, annotations={GPU_MEM_IDX: "1"})
    message = await refusal(mallory.create_namespaced_pod_binding("plain", ns, binding))
    assert message and "ALIYUN_COM_GPU_MEM_IDX" in message, message

    # the binder, as its ServiceAccount, binds the pod and writes the record with the Binding
    await start_binder(api=acting(BINDER))
    plain = await cluster.read("plain")
    reservation = await ledger.reserve(request_for(plain, node, gib=2, gpu=1))
    await state_becomes(engine, reservation, "bound")
    bound = await cluster.read("plain")
    assert bound.spec.node_name == node.name and bound.metadata.annotations[GPU_MEM_IDX] == "1"
    assert json.loads(bound.metadata.annotations[ALLOCATION])["id"] == str(reservation.allocation_id)

    # the user may still change everything else on the pod, not gpushare's keys (changed or removed)
    assert await refusal(mallory.patch_namespaced_pod("plain", ns, annotate("plain", {"team": "vision"}))) is None
    for change in ({GPU_MEM_IDX: "0"}, {GPU_MEM_IDX: None}, {ALLOCATION: None}):
        message = await refusal(mallory.patch_namespaced_pod("plain", ns, annotate("plain", change)))
        assert message and next(iter(change)) in message, (change, message)
    assert (await cluster.read("plain")).metadata.annotations[GPU_MEM_IDX] == "1"

    # during a migration, Aliyun gpushare's extender keeps writing its annotations
    old_extender = client.CoreV1Api(acting(OLD_EXTENDER))
    assert await refusal(old_extender.patch_namespaced_pod("plain", ns, annotate("plain", {GPU_MEM_POD: "2"}))) is None
