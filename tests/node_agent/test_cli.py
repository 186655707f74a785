"""`gpushare node-agent` as a process: clear exit without GPUs; serving, registering and /metrics with fakes."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.cluster.kubelet import KubeletStandIn
from devstack.embedded import free_port
from services.node_agent.agent import RESOURCES
from shared.events.bus import BusNames
from shared.ledger.models import gpus
from tests.system_tools import listening_addresses


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_") and k != "KUBECONFIG"}
    env["HOME"] = tempfile.gettempdir() + "/na-nohome"  # no ~/.kube/config: runs without Kubernetes
    return env


def test_exits_clearly_without_nvml_or_fake_gpus() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "node-agent", "--node", "n1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    if "NVML is not available" not in done.stderr:  # a machine with a GPU: nothing to check here
        assert done.returncode == 0 or "nats" in done.stderr.lower()
        return
    assert done.returncode != 0 and "--fake-gpus" in done.stderr


async def test_agent_process_registers_and_serves_metrics(
    engine: AsyncEngine, gateway: object, nats_url: str, bus_names: BusNames
) -> None:
    """The agent process gets no database URL: the ledger is reached through the binder's gateway."""
    root = Path(tempfile.mkdtemp(prefix="na-cli-", dir="/tmp"))
    kubelet = KubeletStandIn(root / "dp", root / "pr.sock")
    await kubelet.start()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "node-agent",
        "--node", "cli-node", "--fake-gpus", "1x24GiB:NVIDIA-L4",
        "--device-plugin-dir", str(root / "dp"), "--pod-resources-socket", str(root / "pr.sock"),
        "--host", "127.0.0.1", "--metrics-port", str(port), "--nats-url", nats_url,
        "--stream-name", bus_names.stream, "--subject-prefix", bus_names.prefix, "--log-format", "text",
        env=_env(), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await kubelet.wait_registered(RESOURCES, timeout_s=60)
        assert len(kubelet.devices("aliyun.com/gpu-mem")) == 24
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            ready = False
            for _ in range(150):
                try:
                    ready = (await http.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    pass
                if ready:
                    break
                await asyncio.sleep(0.2)
            assert ready, "the agent is ready once the ledger holds its inventory and its view is loaded"
            metrics = (await http.get("/metrics")).text
            devices = (await http.get("/v1/devices")).json()
        assert listening_addresses(port) == {"127.0.0.1"}, "--host: on the loopback address only"
        assert "gpushare_node_agent_gpu_memory_bytes{" in metrics and "2.5769803776e+10" in metrics  # 24576 MiB
        assert devices["gpus"][0]["model"] == "NVIDIA-L4"
        async with engine.connect() as conn:
            row = (await conn.execute(select(gpus.c.memory_mib, gpus.c.model).where(gpus.c.node == "cli-node"))).one()
        assert row.memory_mib == 24576 and row.model == "NVIDIA-L4"
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
        await kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0, (await proc.stderr.read()).decode()[-2000:] if proc.stderr else ""
