"""Mutual TLS for the extender verbs: a real kube-scheduler with a client certificate reaches filter, prioritize
and bind; a client without one, or with one from another CA, is refused at the handshake. Probes and
Prometheus use the plain `--health-port`, which serves nothing else."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kubernetes_asyncio import client
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.cluster import ControlPlane, ExtenderConfig
from devstack.cluster.nodes import create_gpu_node
from devstack.embedded import free_port
from shared.events.bus import BusNames
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations
from tests import system_tools
from tests.extender.conftest import PREFIX, StandInBinder, add_node
from tests.extender.test_replicas_race import tail
from tests.waiting import eventually

pytestmark = pytest.mark.e2e


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(cert))  # fmt: skip
    return cert, key


def make_cert(d: Path, name: str, ca: tuple[Path, Path], *, server: bool) -> tuple[Path, Path]:
    cert, key, csr, ext = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    usage = "serverAuth" if server else "clientAuth"
    ext.write_text(f"extendedKeyUsage={usage}\n" + ("subjectAltName=IP:127.0.0.1\n" if server else ""))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("mtls")
    ca, rogue_ca = make_ca(d, "gpushare-ca"), make_ca(d, "rogue-ca")
    return {
        "ca": ca,
        "server": make_cert(d, "extender", ca, server=True),
        "scheduler": make_cert(d, "kube-scheduler", ca, server=False),
        "rogue": make_cert(d, "rogue", rogue_ca, server=False),
    }


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def control_plane(certs: dict[str, tuple[Path, Path]], ports: tuple[int, int]) -> Iterator[ControlPlane]:
    """A real kube-scheduler that calls the extender over mutual TLS (the shipped scheduler config's tlsConfig)."""
    scheduler_cert, scheduler_key = certs["scheduler"]
    extender = ExtenderConfig(
        url_prefix=f"https://127.0.0.1:{ports[0]}{PREFIX}",
        tls_config={"certFile": str(scheduler_cert), "keyFile": str(scheduler_key), "caFile": str(certs["ca"][0])},
    )
    paths = system_tools.control_plane_binaries()
    scheduler_extra = {"podInitialBackoffSeconds": 1, "podMaxBackoffSeconds": 2}
    with system_tools.running_control_plane(paths, extender=extender, scheduler_extra=scheduler_extra) as cp:
        yield cp


@pytest.fixture
def extender(
    tmp_path: Path,
    certs: dict[str, tuple[Path, Path]],
    ports: tuple[int, int],
    control_plane: ControlPlane,
    database_url: str,
    nats_url: str,
    bus_names: BusNames,
) -> Iterator[Path]:
    """`gpushare extender` with --tls-client-ca; returns its log path once the health port says ready."""
    port, health = ports
    log = tmp_path / "extender.log"
    cmd = [
        sys.executable, "-m", "services.cli", "extender", "--host", "127.0.0.1", "--port", str(port),
        "--tls-cert", str(certs["server"][0]), "--tls-key", str(certs["server"][1]),
        "--tls-client-ca", str(certs["ca"][0]), "--health-port", str(health),
        "--kubeconfig", str(control_plane.kubeconfig_path), "--bind-timeout", "10",
        "--database-url", database_url, "--nats-url", nats_url,
        "--stream-name", bus_names.stream, "--subject-prefix", bus_names.prefix,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"extender exited:\n{tail(log)}"
            try:
                if httpx.get(f"http://127.0.0.1:{health}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"extender never became ready:\n{tail(log)}"
            time.sleep(0.2)
        yield log
    finally:
        proc.terminate()
        try:
            proc.wait(30)  # an in-flight bind is answered first (up to --bind-timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"the extender did not stop on SIGTERM:\n{tail(log)}") from None


def _context(certs: dict[str, tuple[Path, Path]], client_cert: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs["ca"][0]))
    if client_cert is not None:
        ctx.load_cert_chain(*map(str, certs[client_cert]))
    return ctx


async def _status(url: str, ctx: ssl.SSLContext) -> int | str:
    try:
        async with httpx.AsyncClient(verify=ctx, timeout=5) as c:
            return (await c.post(url, json={"Pod": {"metadata": {"name": "p"}}, "NodeNames": []})).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def test_only_clients_with_a_certificate_from_the_ca_reach_the_verbs(
    extender: Path, certs: dict[str, tuple[Path, Path]], ports: tuple[int, int]
) -> None:
    url = f"https://127.0.0.1:{ports[0]}{PREFIX}/filter"
    assert await _status(url, _context(certs, "scheduler")) == 200
    assert isinstance(await _status(url, _context(certs, None)), str)  # no certificate: handshake refused
    assert isinstance(await _status(url, _context(certs, "rogue")), str)  # another CA's certificate: refused
    health = f"http://127.0.0.1:{ports[1]}"
    async with httpx.AsyncClient(timeout=5) as plain:
        assert (await plain.get(f"{health}/healthz")).status_code == 200
        assert "gpushare_extender" in (await plain.get(f"{health}/metrics")).text
        assert (await plain.post(f"{health}{PREFIX}/filter", json={})).status_code == 404  # no verbs there


async def test_kube_scheduler_binds_through_mutual_tls(
    extender: Path,
    control_plane: ControlPlane,
    ledger: Ledger,
    engine: AsyncEngine,
    binder: StandInBinder,
    certs: dict[str, tuple[Path, Path]],
    ports: tuple[int, int],
) -> None:
    node = f"mtls-{uuid.uuid4().hex[:6]}"
    api = control_plane.api_client()
    try:
        await create_gpu_node(api, node, gpus=[(16, "Tesla-T4")])
        await add_node(ledger, node, [16])
        limits = {"aliyun.com/gpu-mem": "2"}
        # The pod is created once the extender's view holds the node's inventory (its filter passes the node). A pod
        # the extender refuses stays among kube-scheduler's unschedulable pods until a cluster event moves it or 5
        # minutes pass (podMaxInUnschedulablePodsDuration). On a real node the node agent's Node update is that
        # event; here no node agent runs, and under CI load the view once learned the inventory just after
        # kube-scheduler's first filter call: the pod then waited past the test's 60 s.
        url = f"https://127.0.0.1:{ports[0]}{PREFIX}/filter"
        probe = {
            "metadata": {"name": "probe", "namespace": "default", "uid": f"probe-{node}"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
        }

        async def view_has_node() -> bool:
            async with httpx.AsyncClient(verify=_context(certs, "scheduler"), timeout=5) as c:
                answer = (await c.post(url, json={"Pod": probe, "NodeNames": [node]})).json()
            return node in (answer.get("NodeNames") or [])

        assert await eventually(view_has_node, within=30, what="the extender's view to hold the node's GPUs")
        pod = {
            "metadata": {"name": "through-mtls"},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits}}]},
        }
        created = await client.CoreV1Api(api).create_namespaced_pod("default", pod)
        uid = created.metadata.uid

        async def reserved() -> bool:
            async with engine.connect() as conn:
                row = (await conn.execute(select(allocations.c.node).where(allocations.c.pod_uid == uid))).first()
            return row is not None and row.node == node

        # eventually() raises TimeoutError, naming what never came, when the condition stays false; the logs are
        # read when it does (an f-string in `what` would show them as they were before the wait)
        try:
            assert await eventually(reserved, within=60, what="a reservation by kube-scheduler's bind")
        except TimeoutError as exc:
            pod_now = await client.CoreV1Api(api).read_namespaced_pod("through-mtls", "default")
            raise TimeoutError(
                f"{exc}\npod status: {pod_now.status.conditions}\nextender log:\n{tail(extender)}\n"
                f"kube-scheduler log:\n{control_plane.log_tail('kube-scheduler')}"
            ) from None
        assert await eventually(lambda: [e.pod_uid for e in binder.seen] == [uid], what="the reserved event")
        await client.CoreV1Api(api).delete_namespaced_pod("through-mtls", "default", grace_period_seconds=0)
    finally:
        await api.close()
