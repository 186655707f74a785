"""A real local node: its own containerd, runc and kubelet v1.37.2 joined to the local control plane, running real
containers (busybox and pause images made here).

    node = RealNode("gpu-node-1", control_plane, labels={"gpushare": "true"}).start()
    node.device_plugin_dir, node.pod_resources_socket      # where a node agent serves its device plugins
    node.dra_registration_dir, node.dra_plugin_dir, node.cdi_dir   # where a DRA plugin registers and writes CDI
    node.restart_kubelet()                                 # its pods keep running; the device checkpoint is read
    node.stop()                                            # no container, shim, mount or cgroup is left

Everything of one node lives in its own folder (`/tmp/gpushare-nodes/<random>/`, its name in `node`) and cgroup
root, so several nodes (and test runs) share the machine, and `node_cleanup` removes all of it after a stop or a
crash (the next `RealNode.start` sweeps nodes whose owner process is gone). `can_run_real_nodes()` says why a
machine cannot (not root, no cgroups, no overlayfs); the binaries are built on first use (`node_build`).
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import images as node_images
from . import node_cleanup
from .buildtools import Progress, stderr_progress
from .containerd import Containerd, ContainerdDirs
from .node_build import NodeBinaries, NodeUnavailable, ensure_node_binaries
from .realkubelet import KubeletSettings, RealKubelet

if TYPE_CHECKING:
    from .controlplane import ControlPlane

NOT_READY_TAINT = "node.kubernetes.io/not-ready"

__all__ = ["RealNode", "can_run_real_nodes", "node_images_for"]


def can_run_real_nodes() -> str:
    """'' when this machine can run real nodes, else why not (pure reads of the machine, nothing is built)."""
    if os.geteuid() != 0:
        return "real nodes need root (kubelet, containerd and runc manage cgroups, mounts and namespaces)"
    if not node_cleanup.cgroup_mounts():
        return "no cgroup hierarchy is mounted"
    missing = {"memory", "cpu", "pids", "devices", "freezer"} - _enabled_controllers()
    if missing:
        return f"cgroup controllers missing: {', '.join(sorted(missing))}"
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "overlay" not in filesystems.split():
        return "the kernel has no overlay filesystem (containerd's snapshotter)"
    return ""


def _enabled_controllers() -> set[str]:
    """The cgroup controllers the kernel has enabled (/proc/cgroups)."""
    try:
        lines = Path("/proc/cgroups").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {f[0] for f in (line.split() for line in lines) if len(f) >= 4 and f[3] == "1"}


def node_images_for(binaries: NodeBinaries, progress: Progress) -> list[node_images.Image]:
    """The images every local node has: pause (its sandbox image) and busybox."""
    return [node_images.pause_image(binaries.release, progress), node_images.busybox_image(progress)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 (never handed out twice by this process)."""
    from devstack.embedded import free_port as free

    return free()


class RealNode:
    """One real node (see the module docstring). Attributes after `start()`: `folder`, `kubelet`, `containerd`,
    `start_seconds`."""

    def __init__(
        self,
        name: str,
        control_plane: ControlPlane,
        *,
        binaries: NodeBinaries | None = None,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        max_pods: int = 110,
        log_dir: Path | None = None,
        progress: Progress = stderr_progress,
        verbosity: int = 2,
        status_update_s: int = 10,
    ) -> None:
        self.name = name
        self.control_plane = control_plane
        self.binaries = binaries
        self.labels = dict(labels or {})
        self.taints = list(taints)
        self.max_pods = max_pods
        self.log_dir = log_dir
        self.progress = progress
        self.verbosity = verbosity
        self.status_update_s = status_update_s
        self.folder = Path()
        self.cgroup_root = ""
        self.containerd: Containerd | None = None
        self.kubelet: RealKubelet | None = None
        self.start_seconds = 0.0
        self.images: list[node_images.Image] = []  # what the node's containerd has (pause, busybox)
        self._started = False

    @property
    def workload_image(self) -> str:
        """The name of the busybox image every local node has (for test and demo pods, `imagePullPolicy: Never`)."""
        return next(i.name for i in self.images if i.name.startswith(node_images.BUSYBOX_REPOSITORY))

    # -- where things are ------------------------------------------------------------------------------------
    @property
    def root_dir(self) -> Path:
        """kubelet's --root-dir."""
        return self.folder / "kubelet"

    @property
    def device_plugin_dir(self) -> Path:
        """Where kubelet serves `kubelet.sock` and device plugins put their sockets."""
        return self.root_dir / "device-plugins"

    @property
    def pod_resources_socket(self) -> Path:
        """kubelet's pod-resources API."""
        return self.root_dir / "pod-resources" / "kubelet.sock"

    @property
    def dra_registration_dir(self) -> Path:
        """kubelet's plugin registration folder (DRA plugins put their registration socket here)."""
        return self.root_dir / "plugins_registry"

    @property
    def dra_plugin_dir(self) -> Path:
        """Where a DRA plugin keeps its service socket (kubelet's plugins folder)."""
        return self.root_dir / "plugins" / "gpu.gpushare.io"

    @property
    def cdi_dir(self) -> Path:
        """The CDI spec folder this node's containerd reads."""
        return self.folder / "cdi"

    @property
    def listens(self) -> str:
        """Where kubelet serves (logs, exec, through kube-apiserver) and its containerd socket."""
        if self.kubelet is None or self.containerd is None:
            return "(not started)"
        port = self.kubelet.settings.port
        return f"https://127.0.0.1:{port} (containerd {self.containerd.dirs.socket})"

    @property
    def logs(self) -> dict[str, Path]:
        """kubelet's and containerd's logs."""
        base = self.log_dir or self.folder
        return {"kubelet": base / f"kubelet-{self.name}.log", "containerd": base / f"containerd-{self.name}.log"}

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> RealNode:
        """Obtain the binaries and images, start containerd and kubelet, wait until the Node is Ready."""
        if self._started:
            return self
        why = can_run_real_nodes()
        if why:
            raise NodeUnavailable(why)
        binaries = self.binaries or ensure_node_binaries(self.control_plane.release, self.progress)
        self.binaries = binaries
        images = self.images = node_images_for(binaries, self.progress)
        node_cleanup.sweep_stale(progress=self.progress)
        t0 = time.monotonic()
        self.folder = node_cleanup.make_node_folder(self.name)
        tag = self.folder.name
        self._started = True
        try:
            self.cgroup_root = f"/gpushare-{self.name}-{tag}"
            (self.folder / node_cleanup.CGROUP_FILE).write_text(self.cgroup_root + "\n")
            node_cleanup.create_cgroup_root(self.cgroup_root)
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
            self.containerd = Containerd(
                ContainerdDirs(self.folder / "containerd"), binaries, node_images.PAUSE_IMAGE, self.cdi_dir,
                self.logs["containerd"], self.progress,
            )  # fmt: skip
            self.containerd.start()
            self.containerd.import_images(images)
            self.kubelet = RealKubelet(binaries.kubelet, self._kubelet_settings(), self.folder, self.logs["kubelet"])
            self.kubelet.start()
            self.kubelet.wait_healthy(timeout_s)
            self.publish_address(timeout_s)
            self.wait_ready(timeout_s)
            self.untaint_not_ready()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        self.progress(f"real node {self.name} Ready in {self.start_seconds:.1f}s (kubelet {binaries.release})")
        return self

    def _kubelet_settings(self) -> KubeletSettings:
        assert self.containerd is not None
        cp = self.control_plane
        return KubeletSettings(
            node=self.name,
            root_dir=self.root_dir,
            pod_logs_dir=self.folder / "pod-logs",
            cgroup_root=self.cgroup_root,
            containerd_endpoint=self.containerd.endpoint,
            kubeconfig=cp.kubeconfig_path,
            client_ca=cp.kubelet_client_ca,
            port=free_port(),
            healthz_port=free_port(),
            labels=self.labels,
            taints=self.taints,
            max_pods=self.max_pods,
            verbosity=self.verbosity,
            status_update_s=self.status_update_s,
        )

    def stop(self) -> list[str]:
        """Stop kubelet, then end every container, shim, mount and cgroup of the node and remove its folder;
        returns what could not be removed ([] normally)."""
        if not self._started:
            return []
        self._started = False
        if self.kubelet is not None:
            self.kubelet.stop()
        problems = node_cleanup.cleanup(self.folder, self.cgroup_root or None)
        if problems:
            self.progress(f"real node {self.name}: left behind: {'; '.join(problems)}")
        return problems

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart_kubelet(self, *, crash: bool = False, timeout_s: float = 60.0) -> None:
        """Restart kubelet (SIGTERM, or SIGKILL with `crash`); containers keep running, kubelet reads its
        checkpoints (device manager, DRA) and syncs them again. Returns once it is healthy and the node Ready."""
        assert self.kubelet is not None
        self.kubelet.restart(crash=crash, timeout_s=timeout_s)
        self.wait_ready(timeout_s)

    # -- the API's view ---------------------------------------------------------------------------------------
    def publish_address(self, timeout_s: float = 60.0) -> None:
        """Give the registered Node its address, 127.0.0.1 (and its name as Hostname).

        kubelet refuses a loopback node IP (`validateNodeIP` in pkg/kubelet/nodestatus/setters.go: "nodeIP can't be
        loopback address") and then sets no address at all, logging that error at each status update; without
        `--node-ip` it would take the machine's outward address, where nothing may listen. So the node's address
        is written here once the Node exists; kubelet's status updates, whose address setter keeps failing, leave
        it as it is (their patch holds only what kubelet changed). kube-apiserver then reaches kubelet at
        127.0.0.1 and the port the node reports."""
        deadline = time.monotonic() + timeout_s
        while self.api_get(f"/api/v1/nodes/{self.name}") is None:
            if time.monotonic() > deadline:
                assert self.kubelet is not None
                raise NodeUnavailable(f"kubelet did not register node {self.name}: {self.kubelet.log_tail()}")
            time.sleep(0.1)
        addresses = [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}]
        self.api_request("PATCH", f"/api/v1/nodes/{self.name}/status", {"status": {"addresses": addresses}})

    def untaint_not_ready(self, attempts: int = 10) -> None:
        """Remove the `node.kubernetes.io/not-ready` taint the API server put on the new Node: the node-lifecycle
        controller would, once kubelet reports Ready, but the local control plane runs without it (its simulated
        nodes renew no lease). The patch names the resourceVersion it read, so a taint added meanwhile is kept."""
        for attempt in range(attempts):
            node = self.api_get(f"/api/v1/nodes/{self.name}") or {}
            taints = (node.get("spec") or {}).get("taints") or []
            keep = [t for t in taints if t.get("key") != NOT_READY_TAINT]
            if len(keep) == len(taints):
                return
            body = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {"taints": keep}}
            try:
                self.api_request("PATCH", f"/api/v1/nodes/{self.name}", body)
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 409 or attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))

    def api_get(self, path: str) -> dict[str, Any] | None:
        """GET `path` from the API server as the admin (None on 404)."""
        return self.api_request("GET", path)

    def api_request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """One request to the API server as the admin (a body is sent as a merge patch); None on 404."""
        cp = self.control_plane
        headers = {"Authorization": f"Bearer {cp.token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(cp.server_url + path, data=data, method=method, headers=headers)
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        try:
            with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
                return dict(json.load(resp))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def ready(self) -> bool:
        """Whether the Node reports Ready=True."""
        try:
            node = self.api_get(f"/api/v1/nodes/{self.name}")
        except (urllib.error.URLError, OSError):
            return False
        conditions = ((node or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the Node is Ready; NodeUnavailable with kubelet's log's end when it is not in time."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            assert self.kubelet is not None
            if not self.kubelet.running():
                raise NodeUnavailable(f"kubelet of {self.name} exited: {self.kubelet.log_tail()}")
            if time.monotonic() > deadline:
                raise NodeUnavailable(f"node {self.name} not Ready after {timeout_s:.0f}s: {self.kubelet.log_tail()}")
            time.sleep(0.2)

    def rss_kib(self) -> dict[str, int]:
        """Resident memory of kubelet and containerd now (KiB)."""
        return {
            "kubelet": self.kubelet.rss_kib() if self.kubelet else 0,
            "containerd": self.containerd.rss_kib() if self.containerd else 0,
        }
