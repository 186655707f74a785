"""`kubectl inspect gpushare` with nothing but a kubeconfig, on the real control plane.

Real kubectl runs the plugin (`kubectl-inspect-gpushare` on PATH) with the stack's kubeconfig. Accounting is
reached the way a user reaches it in a cluster: through the API server's service proxy, here to an accounting
replica published as Service `gpushare-accounting` (port `http`) whose EndpointSlice points at a pod object
carrying the address accounting listens on (kube-apiserver proxies only to endpoints that are pods' IPs, and
never to loopback ones; no kube-proxy is involved). Without that Service, and once accounting stops answering,
the plugin shows what the API server alone tells (node capacity and the pods' gpushare annotations, written
by the real binder) and says so in one line: the same tables accounting shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from devstack.cluster import Paths
from devstack.cluster.nodes import create_gpu_node
from shared.settings import Settings
from tests.accounting.live import LiveServer
from tests.deploy.tools import K8S, find, load_all
from tests.e2e import helpers as h
from tests.system_tools import ensure_tool, running_control_plane, unavailable

pytestmark = pytest.mark.e2e

STACK_NODES = 2
STACK_GPUS = "2x16GiB:Tesla-T4"
ROOT = Path(__file__).resolve().parents[2]
POLICY = "gpushare.io/policy"
# name -> (gpu-mem of each container in GiB, gpu-count)
PODS: dict[str, tuple[list[int], int | None]] = {
    "train": ([6], None),
    "infer": ([2], None),
    "pair": ([3, 1], None),
    "ddp": ([8], 2),
}


def host_address() -> str:
    """This machine's IPv4 address that is not loopback (the API server's proxy refuses loopback endpoints)."""
    found = []
    for probe in ("10.254.254.254", "192.0.2.1"):  # a UDP connect sends nothing: it only picks the source address
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((probe, 9))
            except OSError as exc:
                found.append(f"{probe}: {exc}")
                continue
            address = sock.getsockname()[0]
        if not address.startswith(("127.", "169.254.", "0.")):
            return address
        found.append(f"{probe}: {address}")
    unavailable(f"no non-loopback IPv4 address to publish accounting on ({'; '.join(found)})")
    raise AssertionError("unreachable")


def plugin_env(home: Path) -> dict[str, str]:
    """kubectl's environment: the plugin on PATH running this checkout, no accounting URL, no ~/.kube/config."""
    bindir = Path(sys.executable).parent
    if not (bindir / "kubectl-inspect-gpushare").exists():
        unavailable(f"kubectl-inspect-gpushare is not installed in {bindir} (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k not in {"GPUSHARE_ACCOUNTING_URL", "KUBECONFIG"}}
    return {**env, "PATH": f"{bindir}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(ROOT), "HOME": str(home)}


class Kubectl:
    """Runs `kubectl inspect gpushare ARGS` as a user would."""

    def __init__(self, binary: str, env: dict[str, str]) -> None:
        self.binary = binary
        self.env = env

    async def inspect(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            self.binary,
            "inspect",
            "gpushare",
            *args,
            env={**self.env, **(env or {})},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def publish_accounting(api: client.ApiClient, namespace: str, address: str, port: int) -> None:
    """Service `gpushare-accounting` (port `http`) with one ready endpoint: a pod object whose IP is `address`."""
    core = client.CoreV1Api(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpushare-accounting-0", "labels": {"app.kubernetes.io/name": "gpushare-accounting"}},
        "spec": {
            "schedulingGates": [{"name": "gpushare.io/e2e-stands-for-accounting"}],  # never scheduled
            "containers": [
                {"name": "accounting", "image": "gpushare", "ports": [{"name": "http", "containerPort": port}]}
            ],
        },
    }
    await core.create_namespaced_pod(namespace, pod)
    status = {"status": {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}]}}
    await core.patch_namespaced_pod_status("gpushare-accounting-0", namespace, status)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gpushare-accounting"},
        "spec": {"ports": [{"name": "http", "port": 8080, "targetPort": port}]},  # no selector: our own slice
    }
    await core.create_namespaced_service(namespace, service)
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "gpushare-accounting-1", "labels": {"kubernetes.io/service-name": "gpushare-accounting"}},
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "namespace": namespace, "name": "gpushare-accounting-0"},
            }
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }
    await client.DiscoveryV1Api(api).create_namespaced_endpoint_slice(namespace, endpoints)


async def place(api: client.ApiClient, stack: Any, namespace: str) -> None:
    """The pods of PODS bound, in the ledger, with the binder's annotations."""
    for name, (mems, count) in PODS.items():
        await h.create_pod(api, namespace, h.gpu_pod(name, mems, count=count, annotations={POLICY: "binpack"}))
    await h.wait_bound(api, namespace, list(PODS))
    await h.wait_ledger(stack.database_url, namespace, list(PODS))


async def test_kubectl_inspect_reads_accounting_through_the_apiserver_or_the_apiserver_alone(
    stack: Any, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    kubectl = Kubectl(ensure_tool(("kubectl",), "kubernetes-client"), plugin_env(tmp_path))
    kubeconfig = ["--kubeconfig", str(stack.kubeconfig)]
    await place(api, stack, namespace)
    node = stack.node_names[0]

    # 1. No accounting Service in the namespace asked for: the API server alone, said in one line.
    nowhere = ["-n", f"{namespace}-none"]

    async def agrees(*args: str) -> tuple[str, str] | None:
        code, out, err = await kubectl.inspect(*kubeconfig, *nowhere, *args)
        assert code == 0, err
        return (out, err) if out == await h.inspect(stack, *args) else None

    for args in ((), ("-d",), ("-d", node)):
        out, err = await h.poll(
            lambda args=args: agrees(*args), 60, what=f"the API server's view {args} = accounting's"
        )
        (line,) = err.splitlines()
        assert line.startswith(f"note: accounting is unreachable (service {namespace}-none/gpushare-accounting"), err
        assert "503 no endpoints available" in line, err  # what the API server says for a Service it lacks
        assert "what the API server alone knows" in line, err
    table = await h.inspect(stack)
    assert f"{sum(sum(mems) for mems, _ in PODS.values())}/64" in table, table  # the pods' 20 GiB are in the tables
    code, out, err = await kubectl.inspect(*kubeconfig, *nowhere, "-o", "json")
    shown = json.loads(out)
    assert code == 0 and shown["source"] == "kubernetes" and shown["memory_unit"] == "GiB"
    assert {g["uuid"] for n in shown["nodes"] for g in n["gpus"]} == {None}
    code, out, err = await kubectl.inspect(*kubeconfig, *nowhere, "ghost-node")
    assert code == 1 and "no GPU-sharing node 'ghost-node'" in err and out == "", err

    # 2. Accounting published as gpushare-accounting: read through the service proxy, nothing to note.
    address = host_address()
    settings = Settings(stream_name=stack.config.stream_name, subject_prefix=stack.config.subject_prefix)
    with LiveServer(stack.database_url, settings, host=address) as accounting:
        await publish_accounting(api, namespace, address, accounting.port)
        proxied = ["-n", namespace]
        for args in ((), ("-d",), ("-d", node), ("-o", "wide")):
            code, out, err = await kubectl.inspect(*kubeconfig, *proxied, *args)
            assert (code, err) == (0, ""), err
            assert out == await h.inspect(stack, *args), args
        code, out, err = await kubectl.inspect(
            *proxied, "-o", "json", "--context", "gpushare-dev", env={"KUBECONFIG": str(stack.kubeconfig)}
        )
        assert code == 0 and err == "", err
        shown = json.loads(out)
        assert shown["source"] == "accounting" and None not in {g["uuid"] for n in shown["nodes"] for g in n["gpus"]}
        code, out, err = await kubectl.inspect(*kubeconfig, *proxied, "ghost-node")
        assert code == 1 and "ghost-node" in err and "note:" not in err and out == "", err  # accounting's 404

    # 3. The Service stays, accounting is gone: the API server alone again, and the note says why.
    code, out, err = await kubectl.inspect(*kubeconfig, *proxied)
    assert code == 0 and out == await h.inspect(stack), out
    (line,) = err.splitlines()
    assert line.startswith(f"note: accounting is unreachable (service {namespace}/gpushare-accounting"), err
    assert " 503 " in line or " 502 " in line, err

    # 4. GPUSHARE_ACCOUNTING_URL wins over any kubeconfig; a context that does not exist is named.
    code, out, err = await kubectl.inspect(*kubeconfig, env={"GPUSHARE_ACCOUNTING_URL": stack.accounting_url})
    assert (code, err) == (0, "") and out == await h.inspect(stack), err
    code, out, err = await kubectl.inspect(*kubeconfig, "--context", "no-such-context")
    assert code == 2 and "no-such-context" in err and "Traceback" not in err, err
    code, out, err = await kubectl.inspect("--version")
    assert code == 0 and out.startswith("gpushare "), out
    code, out, err = await kubectl.inspect("--help")
    assert code == 0 and out.startswith("usage: kubectl inspect gpushare"), out


async def test_rbac_decides_who_may_look(control_plane_binaries: Paths, database_url: str, tmp_path: Path) -> None:
    """On an API server that authorizes with RBAC: the shipped `gpushare-inspect` role lets a user read accounting
    through the service proxy; a user who may only list nodes and pods gets the API server's view (and the note
    says the proxy was forbidden); a user with neither is told both refusals."""
    users = {name: secrets.token_hex(16) for name in ("alice", "carol", "bob")}
    kubectl = Kubectl(ensure_tool(("kubectl",), "kubernetes-client"), plugin_env(tmp_path))
    address = host_address()
    with running_control_plane(control_plane_binaries, authorization_mode="RBAC", users=users) as cp:
        async with cp.api_client() as api:
            rbac = client.RbacAuthorizationV1Api(api)
            role = find(load_all((K8S / "base" / "rbac.yaml").read_text()), "ClusterRole", "gpushare-inspect")
            await rbac.create_cluster_role(role)
            listing = {"metadata": {"name": "list-nodes-pods"}, "rules": [role["rules"][1]]}
            assert role["rules"][1]["resources"] == ["nodes", "pods"]
            await rbac.create_cluster_role(listing)
            for user, granted in (("alice", "gpushare-inspect"), ("carol", "list-nodes-pods")):
                await rbac.create_cluster_role_binding(
                    {
                        "metadata": {"name": f"{user}-{granted}"},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": granted},
                        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
                    }
                )
            await create_gpu_node(api, "rbac-gpu-0", gpus=[(16, "Tesla-T4"), (16, "Tesla-T4")])
            await client.CoreV1Api(api).create_namespace({"metadata": {"name": "gpushare-system"}})
            with LiveServer(database_url, Settings(), host=address) as accounting:
                await publish_accounting(api, "gpushare-system", address, accounting.port)

                async def as_user(user: str) -> tuple[int, str, str]:
                    kubeconfig = cp.user_kubeconfig(user, tmp_path / f"{user}.kubeconfig")
                    return await kubectl.inspect("-o", "json", env={"KUBECONFIG": str(kubeconfig)})

                code, out, err = await as_user("alice")
                assert (code, err) == (0, "") and json.loads(out)["source"] == "accounting", err
                code, out, err = await as_user("carol")
                assert code == 0 and json.loads(out)["source"] == "kubernetes", err
                assert [n["name"] for n in json.loads(out)["nodes"]] == ["rbac-gpu-0"]
                (line,) = err.splitlines()
                assert line.startswith("note: accounting is unreachable") and "403" in line and "carol" in line, err
                code, out, err = await as_user("bob")
                assert code == 2 and out == "" and err.count("403") == 2 and "Traceback" not in err, err
                assert 'User "bob" cannot get resource "services/proxy"' in err, err
                assert 'User "bob" cannot list resource "nodes"' in err, err
