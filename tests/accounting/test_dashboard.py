"""The dashboard in a real headless Chromium against a seeded ledger."""

from __future__ import annotations

import asyncio
import re
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

from services.accounting.scheduling import SchedulingWaits
from shared.events.catalogue import UsageEvent, UsageSample
from shared.kube.watching import ADDED, WatchEvent
from tests.system_tools import ensure_tool

from .conftest import LiveServer, Stack

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def chromium() -> str:
    """Debian's Chromium (installed on first use)."""
    return ensure_tool(("chromium", "chromium-browser"), "chromium")


async def _browse(url: str, *extra: str) -> str:
    with tempfile.TemporaryDirectory(prefix="gpushare-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--window-size=1280,1400",
            "--virtual-time-budget=4000",
            *extra,
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


def SCHEDULING(stack: Stack) -> SchedulingWaits:
    """The pod watch's view: huge-0 (refused in the seed) was created three minutes ago."""
    waits = SchedulingWaits(stack.engine, lambda *a: None, horizon_s=3600)
    huge = {
        "metadata": {"name": "huge-0", "namespace": "team-b", "uid": "uid-big"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "20"}}}]},
    }
    created = datetime.now(UTC) - timedelta(minutes=3)  # when the live server starts, just before the browser
    huge["metadata"]["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    waits.handle(WatchEvent(ADDED, huge))
    return waits


async def test_dashboard_renders_the_seeded_ledger(seeded: Stack, live_server: LiveServer) -> None:
    sample = UsageSample(
        gpu_uuid="GPU-0-0",
        pod_uid="uid-a",
        namespace="team-a",
        pod_name="bert-1",
        container="main",
        used_memory_mib=1200,
        sm_utilization_pct=37.5,
    )
    await seeded.bus.publish(UsageEvent(node="node-0", samples=[sample]))
    await seeded.settle()
    dom = await _browse(live_server.url + "/ui", "--dump-dom")
    assert 'data-loaded="true"' in dom, dom[-3000:]
    # Per node and per GPU bars.
    assert 'data-node="node-0"' in dom and 'data-node="node-1"' in dom
    for gpu in ("GPU-0-0", "GPU-0-1", "GPU-1-0", "GPU-1-1"):
        assert f'data-gpu="{gpu}"' in dom
    assert "alloc 2 GiB / 15 GiB, used 1.2 GiB" in dom
    assert "12 GiB / 60 GiB" in dom
    # Pending pods with their reasons, and how long they have waited since their creation.
    assert "team-b/huge-0" in dom and "node-0: needs 20 GiB on one GPU, largest free 13 GiB" in dom
    assert re.search(r"<td>team-b/huge-0</td><td>3m \d+s</td>", dom), dom[dom.find('id="pending"') :][:600]
    # Each GPU pod's SM utilisation beside its memory (n/a where never measured), named by its workload.
    pods = dom[dom.find('id="pods"') :]
    assert re.search(r"<td>team-a/bert-1</td><td>Deployment/bert</td><td>node-0</td><td>1.2 GiB / 2 GiB</td>", pods)
    assert "<span>37.5 %</span>" in pods and 'style="width: 37.5%;"' in pods
    assert re.search(r"<td>team-a/bert-2</td>.*?n/a", pods)
    # Top namespaces and right-sizing.
    assert "<td>team-a</td>" in dom and "<td>team-b</td>" in dom
    assert "team-a/Deployment/bert" in dom and "allocates 2 GiB, peaks at 1.3 GiB" in dom
    assert '<span id="error"></span>' in dom  # no failed refresh

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "accounting-dashboard.png"
    shot.unlink(missing_ok=True)
    await _browse(live_server.url + "/ui", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000
