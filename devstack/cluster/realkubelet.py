"""One kubelet per local real node: its configuration and process.

Several kubelets share the machine, so each has its own root directory (`--root-dir`: the device-plugin,
pod-resources and DRA plugin-registration sockets live under it), pod log folder, ports (the API port kubelet
serves logs and exec on, healthz; the read-only port off), cgroup root (`cgroupRoot`, so two kubelets never share
`/kubepods`), containerd, and certificate folder; nothing listens anywhere but 127.0.0.1, and the node's address is
127.0.0.1 (`--node-ip`). What the machine imposes: cgroup v1 (`failCgroupV1: false`, `cgroupDriver: cgroupfs`), no
CAP_SYS_RESOURCE (`oomScoreAdj: 0`), no swap (`failSwapOn: false`), local images only (image garbage collection
off: nothing could pull them again). The field names are `k8s.io/kubelet/config/v1beta1`'s (v0.37.2).

kubelet v1.37.2 serves its device-plugin Registration socket at a fixed path, `/var/lib/kubelet/device-plugins/
kubelet.sock` (`pluginapi.KubeletSocket`, used by `devicemanager.NewManagerImpl`; `--root-dir` moves the pod-resources
and plugin-registration sockets, not that one), and keeps its device checkpoint beside it. So each kubelet runs in
a mount namespace of its own (`unshare --mount`), where its node's `<root-dir>/device-plugins` is bind-mounted on
that path; its root directory is a shared mount, so the volumes kubelet mounts for pods there still reach
containerd, which runs outside. The node agent is given `<root-dir>/device-plugins` and sees the same sockets.

kube-apiserver reaches each kubelet at the node's InternalIP and the port the node reports
(`--kubelet-preferred-address-types=InternalIP`), with a client certificate of its own that kubelet trusts
(`ControlPlane.kubelet_client_ca`): `kubectl logs` and `kubectl exec` work as on any cluster.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .node_build import NodeUnavailable
from .node_cleanup import rss_kib

DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins"  # pluginapi.DevicePluginPath, kubelet's fixed folder
IN_NAMESPACE = (
    'set -e; src="$1"; dst="$2"; shift 2; '
    'mount --make-slave "$(findmnt -n -o TARGET -T "$dst")"; '
    'mount --bind "$src" "$dst"; exec "$@"'
)
"""Run in kubelet's new mount namespace: bind the node's device-plugin folder on the fixed one, then exec kubelet."""


@dataclass(frozen=True)
class KubeletSettings:
    """What differs between the local kubelets, and what a test may tune."""

    node: str
    root_dir: Path
    pod_logs_dir: Path
    cgroup_root: str
    containerd_endpoint: str
    kubeconfig: Path
    client_ca: Path | None  # kube-apiserver's kubelet-client CA (None: anonymous requests are allowed)
    port: int
    healthz_port: int
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()
    max_pods: int = 110
    # the longest back-off between restarts of a crashing container (kubelet's default is 300 s; the local nodes
    # take 10 s, kubelet's first back-off, so a crash loop is seen again within seconds)
    max_restart_backoff_s: int = 10
    status_update_s: int = 10  # nodeStatusUpdateFrequency (kubelet's default)
    verbosity: int = 2


def kubelet_config(s: KubeletSettings) -> dict[str, Any]:
    """The KubeletConfiguration of one local node (pure)."""
    authentication: dict[str, Any] = {"webhook": {"enabled": False}}
    if s.client_ca is not None:
        authentication |= {"x509": {"clientCAFile": str(s.client_ca)}, "anonymous": {"enabled": False}}
    else:
        authentication |= {"anonymous": {"enabled": True}}
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": s.port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": s.healthz_port,
        "authentication": authentication,
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": s.containerd_endpoint,
        "imageServiceEndpoint": s.containerd_endpoint,
        "podLogsDir": str(s.pod_logs_dir),
        "volumePluginDir": str(s.root_dir / "volume-plugins"),
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": s.cgroup_root,
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        "oomScoreAdj": 0,
        "maxPods": s.max_pods,
        "registerNode": True,
        "registerWithTaints": [dict(t) for t in s.taints],
        "nodeStatusUpdateFrequency": f"{s.status_update_s}s",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
            "imagefs.inodesFree": "1%",
        },
        "crashLoopBackOff": {"maxContainerRestartPeriod": f"{s.max_restart_backoff_s}s"},
        "resolvConf": "/etc/resolv.conf",
        "enableDebuggingHandlers": True,  # logs, exec, port-forward through the API server
        "serializeImagePulls": False,
        "logging": {"format": "text"},
    }


def shared_mount(folder: Path) -> None:
    """Make `folder` a shared mount of its own (a bind mount on itself), once: what kubelet mounts under it in its
    own mount namespace then appears here too."""
    if any(line.split()[4] == str(folder) for line in Path("/proc/self/mountinfo").read_text().splitlines()):
        return
    for cmd in (["mount", "--bind", str(folder), str(folder)], ["mount", "--make-shared", str(folder)]):
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode:
            raise NodeUnavailable(f"{' '.join(cmd)} failed: {res.stderr.strip()}")


class RealKubelet:
    """One node's kubelet process (`start`, `stop`, `restart`, `kill`)."""

    def __init__(self, binary: Path, settings: KubeletSettings, work: Path, log: Path) -> None:
        self.binary = binary
        self.settings = settings
        self.work = work
        self.log = log
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def config_path(self) -> Path:
        return self.work / "kubelet-config.json"

    def argv(self) -> list[str]:
        """kubelet's command line (the rest is in its configuration file), in its own mount namespace where the
        node's device-plugin folder is kubelet's fixed one (`DEVICE_PLUGIN_PATH`)."""
        s = self.settings
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        # --propagation unchanged: the root directory's shared mount stays a peer of the host's; the fixed folder's
        # mount (made a slave first, should it be shared) takes the bind mount for this kubelet alone
        namespace = ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", IN_NAMESPACE, "kubelet-ns"]
        return [
            *namespace,
            str(s.root_dir / "device-plugins"),
            DEVICE_PLUGIN_PATH,
            str(self.binary),
            f"--config={self.config_path}",
            f"--kubeconfig={s.kubeconfig}",
            f"--root-dir={s.root_dir}",
            f"--cert-dir={s.root_dir / 'pki'}",
            f"--hostname-override={s.node}",
            "--node-ip=127.0.0.1",
            *([f"--node-labels={labels}"] if labels else []),
            f"--v={s.verbosity}",
        ]

    def start(self) -> None:
        """Write the configuration and start kubelet (`wait_healthy` waits for it)."""
        self.work.mkdir(parents=True, exist_ok=True)
        (self.settings.root_dir / "device-plugins").mkdir(parents=True, exist_ok=True)
        Path(DEVICE_PLUGIN_PATH).mkdir(parents=True, exist_ok=True)  # the mount point (stays empty on the host)
        shared_mount(self.settings.root_dir)
        self.settings.pod_logs_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(kubelet_config(self.settings), indent=2))
        self.starts += 1
        with self.log.open("ab") as fh:
            fh.write(f"\n==== starting kubelet at {time.ctime()}\n".encode())
            fh.flush()
            self.popen = subprocess.Popen(
                self.argv(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def healthy(self) -> bool:
        """Whether kubelet answers ok on its healthz port."""
        url = f"http://127.0.0.1:{self.settings.healthz_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until kubelet's healthz answers ok; NodeUnavailable (with its log's end) when it exits or does not."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.popen is not None and self.popen.poll() is not None:
                raise NodeUnavailable(f"kubelet exited with {self.popen.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise NodeUnavailable(f"kubelet not healthy after {timeout_s:.0f}s: {self.log_tail()}")
            time.sleep(0.1)

    def running(self) -> bool:
        """Whether the kubelet process runs."""
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM kubelet (SIGKILL after `grace_s`). Its pods keep running in containerd, as on a real node."""
        if not self.running():
            return
        assert self.popen is not None
        self.popen.terminate()
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL kubelet (a crash)."""
        if self.running():
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(10)

    def restart(self, *, crash: bool = False, timeout_s: float = 60.0) -> None:
        """Stop (or, with `crash`, kill) kubelet and start it again with the same configuration."""
        self.kill() if crash else self.stop()
        self.start()
        self.wait_healthy(timeout_s)

    def rss_kib(self) -> int:
        """kubelet's resident memory now (KiB; 0 when it is not running)."""
        if not self.running():
            return 0
        assert self.popen is not None
        return rss_kib(self.popen.pid)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of kubelet's log."""
        try:
            return self.log.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""
