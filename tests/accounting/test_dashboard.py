"""The dashboard in a real headless Chromium against a seeded ledger."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

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


async def test_dashboard_renders_the_seeded_ledger(seeded: Stack, live_server: LiveServer) -> None:
    dom = await _browse(live_server.url + "/ui", "--dump-dom")
    assert 'data-loaded="true"' in dom, dom[-3000:]
    # Per node and per GPU bars.
    assert 'data-node="node-0"' in dom and 'data-node="node-1"' in dom
    for gpu in ("GPU-0-0", "GPU-0-1", "GPU-1-0", "GPU-1-1"):
        assert f'data-gpu="{gpu}"' in dom
    assert "alloc 2 GiB / 15 GiB, used 1.2 GiB" in dom
    assert "12 GiB / 60 GiB" in dom
    # Pending pods with their reasons.
    assert "team-b/huge-0" in dom and "node-0: needs 20 GiB on one GPU, largest free 13 GiB" in dom
    # Top namespaces and right-sizing.
    assert "<td>team-a</td>" in dom and "<td>team-b</td>" in dom
    assert "team-a/Deployment/bert" in dom and "allocates 2 GiB, peaks at 1.3 GiB" in dom
    assert '<span id="error"></span>' in dom  # no failed refresh

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "accounting-dashboard.png"
    shot.unlink(missing_ok=True)
    await _browse(live_server.url + "/ui", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000
