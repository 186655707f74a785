"""`make run` on real nodes: `gpushare up` as a newcomer runs it (`--nodes-kind auto`, the default), on a machine that
can run containers: a device-plugin node and a DRA node, each a real kubelet and containerd; the demo's containers
print the environment they received, shown beside the ledger's record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devstack.cluster import Paths, node_cleanup
from tests.e2e.test_up import _up

pytestmark = pytest.mark.e2e

LEDGER = re.compile(r"^    ledger:    assigned on (\S+): (\S+): GPU (\d+) (\d+) MiB \((GPU-[0-9a-f-]+)\)$")
GOT = re.compile(r"^    (\S+) got: (.*)$")


def demo_blocks(out: str) -> dict[str, dict[str, str]]:
    """Per demo pod: its node, the ledger's GPU, index and MiB, and what its container printed (pure)."""
    lines = out.split("\nDemo containers", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    blocks: dict[str, dict[str, str]] = {}
    pod = ""
    for line in lines:
        if match := re.match(r"^  (\S+) on (\S+)$", line):
            pod = match.group(1)
            blocks[pod] = {"node": match.group(2)}
        elif match := LEDGER.match(line):
            node, _container, index, mib, uuid = match.groups()
            blocks[pod].update(ledger_node=node, index=index, mib=mib, uuid=uuid)
        elif match := GOT.match(line):
            blocks[pod].update(dict(kv.split("=", 1) for kv in match.group(2).split()))
    return blocks


async def test_make_run_runs_the_demo_as_real_containers_on_a_device_plugin_and_a_dra_node(
    tmp_path: Path, up_database: str, nats_url: str, control_plane_binaries: Paths
) -> None:
    code, out = await _up(tmp_path, up_database, nats_url, "--nodes", "2", "--no-usage", limit_s=300)
    assert code == 0, out[-5000:]
    assert "Nodes:      2 real node(s): kubelet, containerd, runc each (gpu-node-1, gpu-node-2)" in out, out[-3000:]
    blocks = demo_blocks(out)
    assert len(blocks) == 8, out[-6000:]  # 6 pods of the demo, 2 of its DRA part
    dra = {p: b for p, b in blocks.items() if p.startswith("gpushare-demo-dra/")}
    assert len(dra) == 2 and {b["node"] for b in dra.values()} == {"gpu-node-2"}, blocks
    assert {b["node"] for p, b in blocks.items() if p not in dra} == {"gpu-node-1"}, blocks
    for pod, b in blocks.items():
        assert b["node"] == b["ledger_node"], (pod, b)
        assert b["NVIDIA_VISIBLE_DEVICES"] == b["uuid"], (pod, b)
        assert b["ALIYUN_COM_GPU_MEM_IDX"] == b["index"], (pod, b)
        assert b["GPUSHARE_GPU_MEMORY_MIB"] == b["mib"], (pod, b)
        assert int(b["ALIYUN_COM_GPU_MEM_CONTAINER"]) * 1024 == int(b["mib"]), (pod, b)
    sockets = re.findall(r"^  kubelet-gpu-node-\d\s+https://127\.0\.0\.1:\d+ \(containerd (\S+)\)$", out, re.M)
    assert len(sockets) == 2, out[-3000:]
    assert "==> stopped" in out
    for socket in sockets:  # stopped: nothing of either node is left
        folder = Path(socket).parents[1]
        assert not folder.exists() and not node_cleanup.mounts_under(folder) and not node_cleanup.pids_naming(folder)
