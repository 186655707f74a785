"""One containerd per local real node: its configuration, process and images.

Several nodes (and several test runs) share the machine, so each containerd has its own root, state, sockets, runc
root, CNI folders and CDI folder, all under its node's folder, and nothing of the machine-wide defaults
(`/var/lib/containerd`, `/run/containerd`, `/etc/cni/net.d`, `/var/run/netns`, `/var/run/nri`, `/opt/containerd`).
What the machine imposes (docs/real-nodes.md): cgroup v1 with the cgroupfs driver (`SystemdCgroup = false`), no
CAP_SYS_RESOURCE (`restrict_oom_score_adj = true`), no registry (the sandbox image is a local one, pinned), and
loopback only (the streaming server on 127.0.0.1, no TCP service, the project's CNI plugin giving each pod
namespace its `lo` and 127.0.0.1).

The field names are those of containerd v2.4.2's configuration version 4 (`version.ConfigVersion`;
internal/cri/config/config.go and the plugins' `Config` structs in the module). CDI is always on in 2.x
(`enable_cdi` is gone): `cdi_spec_dirs` names the node's own CDI folder, which its node agent writes.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .buildtools import Progress
from .images import Image
from .node_build import CNI_PLUGIN, NodeBinaries, NodeUnavailable
from .node_cleanup import rss_kib

CNI_NETWORK = "gpushare-loopback"
K8S_NAMESPACE = "k8s.io"  # the containerd namespace CRI keeps kubelet's images and containers in


@dataclass(frozen=True)
class ContainerdDirs:
    """Where one containerd keeps everything (all under its node's folder)."""

    base: Path

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def socket(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def shim_sockets(self) -> Path:
        return self.base / "s"

    @property
    def runc_root(self) -> Path:
        return self.base / "runc"

    @property
    def cni_conf_dir(self) -> Path:
        return self.base / "cni"

    @property
    def config(self) -> Path:
        return self.base / "config.toml"


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string for the paths and names used here


def config_toml(dirs: ContainerdDirs, binaries: NodeBinaries, sandbox_image: str, cdi_dir: Path) -> str:
    """containerd's configuration for one node (pure)."""
    q = _toml_str
    return f"""version = 4
root = {q(str(dirs.root))}
state = {q(str(dirs.state))}
# nothing machine-wide: NRI would listen on /var/run/nri/nri.sock, tracing would export elsewhere
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]

[plugins.'io.containerd.server.v1.grpc']
  address = {q(str(dirs.socket))}

[plugins.'io.containerd.server.v1.ttrpc']
  address = {q(str(dirs.socket) + ".ttrpc")}

[plugins.'io.containerd.server.v1.debug']
  address = ""

[plugins.'io.containerd.server.v1.metrics']
  address = ""

# the shims' sockets (a 64-character hash each: the folder's path must stay short, a socket's path has 108 bytes)
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = {q(str(dirs.shim_sockets))}

[plugins.'io.containerd.internal.v1.opt']
  path = {q(str(dirs.base / "opt"))}

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = {q(sandbox_image)}

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = [{q(str(cdi_dir))}]
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [{q(str(binaries.cni_bin_dir))}]
    conf_dir = {q(str(dirs.cni_conf_dir))}
    max_conf_num = 1
    use_internal_loopback = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = {q(str(binaries.runc))}
        Root = {q(str(dirs.runc_root))}
        SystemdCgroup = false
"""


def cni_conflist() -> str:
    """The only CNI network of a node: the project's loopback plugin (pure)."""
    return json.dumps(
        {"cniVersion": "1.0.0", "name": CNI_NETWORK, "plugins": [{"type": CNI_PLUGIN}]},
        indent=2,
    )


class Containerd:
    """One node's containerd process."""

    def __init__(
        self, dirs: ContainerdDirs, binaries: NodeBinaries, sandbox_image: str, cdi_dir: Path, log: Path,
        progress: Progress,
    ) -> None:  # fmt: skip
        self.dirs = dirs
        self.binaries = binaries
        self.sandbox_image = sandbox_image
        self.cdi_dir = cdi_dir
        self.log = log
        self.progress = progress
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The CRI endpoint kubelet uses."""
        return f"unix://{self.dirs.socket}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Write the configuration and start containerd; return once it answers."""
        for folder in (self.dirs.base, self.dirs.cni_conf_dir, self.cdi_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.dirs.config.write_text(config_toml(self.dirs, self.binaries, self.sandbox_image, self.cdi_dir))
        (self.dirs.cni_conf_dir / f"10-{CNI_NETWORK}.conflist").write_text(cni_conflist())
        with self.log.open("ab") as fh:
            fh.write(f"\n==== starting containerd at {time.ctime()}\n".encode())
            fh.flush()
            self.popen = subprocess.Popen(
                [str(self.binaries.containerd), "--config", str(self.dirs.config), "--log-level", "info"],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise NodeUnavailable(f"containerd exited with {self.popen.returncode}: {self.log_tail()}")
            if self.dirs.socket.exists() and self.ctr("version", check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise NodeUnavailable(f"containerd did not answer on {self.dirs.socket} in {timeout_s:.0f}s")
            time.sleep(0.05)

    def ctr(self, *args: str, check: bool = True, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `ctr` against this containerd in the k8s.io namespace."""
        cmd = [str(self.binaries.ctr), "--address", str(self.dirs.socket), "--namespace", K8S_NAMESPACE, *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and res.returncode:
            raise NodeUnavailable(f"ctr {' '.join(args)} failed: {(res.stderr or res.stdout).strip()[-800:]}")
        return res

    def import_images(self, images: list[Image]) -> None:
        """Import OCI archives (unpacked for the overlayfs snapshotter, as CRI wants them)."""
        for image in images:
            self.ctr("images", "import", "--local", str(image.archive))
        listed = self.ctr("images", "list", "--quiet").stdout.split()
        missing = [i.name for i in images if i.name not in listed]
        if missing:
            raise NodeUnavailable(f"containerd does not list the images just imported: {missing} (has {listed})")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM containerd (SIGKILL after `grace_s`); the containers it ran are ended by the node's cleanup."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def rss_kib(self) -> int:
        """containerd's resident memory now (KiB; 0 when it is not running)."""
        return rss_kib(self.popen.pid) if self.popen is not None and self.popen.poll() is None else 0

    def log_tail(self, chars: int = 2000) -> str:
        """The end of containerd's log."""
        try:
            return self.log.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""
