"""Real nodes for the stack: `gpushare up --nodes-kind real|stand-in|auto` and the real-node tests.

With real nodes each of the stack's nodes is a `devstack.cluster.realnode.RealNode` (its own containerd and kubelet
v1.37.2, real containers) instead of a Node object made through the API plus a kubelet stand-in; the node agents
register with the real kubelets (device plugins, and on DRA nodes the DRA plugin and CDI) on fake GPUs. `auto` takes
real nodes when the machine can run them (root, cgroups, overlayfs, the binaries built) and the stack runs the local
control plane of the current release, and says why not otherwise; the stand-ins stay for the many-node stacks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from devstack.cluster.buildtools import ControlPlaneUnavailable

if TYPE_CHECKING:
    from devstack.cluster.controlplane import ControlPlane
    from devstack.cluster.realnode import RealNode

NODES_KINDS = ("auto", "real", "stand-in")
REAL, STAND_IN = "real", "stand-in"
REAL_LABEL = "gpushare.io/real-node"  # on every real node (the stand-ins' nodes carry gpushare.io/simulated)
MAX_REAL_NODES = 4  # each is a kubelet (~90 MiB) and a containerd (~50 MiB): a machine for `make run`, not a fleet


class RealNodesUnavailable(ControlPlaneUnavailable):
    """Real nodes were asked for (`--nodes-kind real`) and cannot run here: `reason` says why."""


def real_nodes_obstacle(control_plane: ControlPlane | None, nodes: int, progress: Callable[[str], None]) -> str:
    """'' when the stack can run its nodes as real ones, else why not (building the binaries on first use)."""
    from devstack.cluster.node_build import ensure_node_binaries
    from devstack.cluster.realnode import can_run_real_nodes

    if control_plane is None:
        return "real nodes join the local control plane (this stack has none)"
    if control_plane.release.from_debian_source:
        return f"real nodes run the current release, not {control_plane.release.version}"
    if nodes > MAX_REAL_NODES:
        return f"{nodes} nodes are more than the {MAX_REAL_NODES} real ones a machine runs here"
    why = can_run_real_nodes()
    if why:
        return why
    try:
        ensure_node_binaries(control_plane.release, progress)
    except ControlPlaneUnavailable as exc:
        return f"the node binaries cannot be built: {exc.reason}"
    return ""


def choose_nodes_kind(
    asked: str, control_plane: ControlPlane | None, nodes: int, progress: Callable[[str], None]
) -> tuple[str, str]:
    """(`real` or `stand-in`, why stand-ins when `auto` fell back to them); RealNodesUnavailable when `real`
    was asked for and cannot be had."""
    if asked not in NODES_KINDS:
        raise ValueError(f"nodes kind {asked!r}: expected one of {', '.join(NODES_KINDS)}")
    if asked == STAND_IN:
        return STAND_IN, ""
    why = real_nodes_obstacle(control_plane, nodes, progress)
    if not why:
        return REAL, ""
    if asked == REAL:
        raise RealNodesUnavailable(why)
    return STAND_IN, why


async def start_real_nodes(
    control_plane: ControlPlane,
    labels: Mapping[str, Mapping[str, str]],
    log_dir: Path,
    progress: Callable[[str], None],
    *,
    max_pods: int = 110,
) -> dict[str, RealNode]:
    """Start one real node per entry of `labels` (node name -> its labels), side by side; all or none."""
    from devstack.cluster.realnode import RealNode

    options = {"max_pods": max_pods, "log_dir": log_dir, "progress": progress}
    nodes = {n: RealNode(n, control_plane, labels={**lbl, REAL_LABEL: "true"}, **options) for n, lbl in labels.items()}
    results = await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes.values()), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await stop_real_nodes(nodes)
        raise failed[0]
    return nodes


async def stop_real_nodes(nodes: Mapping[str, RealNode]) -> None:
    """Stop real nodes side by side (each leaves no container, mount or cgroup behind)."""
    await asyncio.gather(*(asyncio.to_thread(n.stop) for n in nodes.values()))


def agent_paths(node: RealNode, dra: bool) -> tuple[str, str, list[str]]:
    """The node agent's device-plugin folder, pod-resources socket and DRA arguments on a real node."""
    extra: list[str] = []
    if dra:
        extra = ["--dra", "--dra-registration-dir", str(node.dra_registration_dir)]
        extra += ["--dra-plugin-dir", str(node.dra_plugin_dir), "--cdi-dir", str(node.cdi_dir)]
    return str(node.device_plugin_dir), str(node.pod_resources_socket), extra
