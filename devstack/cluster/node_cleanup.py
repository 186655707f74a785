"""Leave nothing behind a local real node: its processes, mounts and cgroups, found by its own folder and cgroup.

Every real node lives in one folder (`/tmp/gpushare-nodes/<random>/`, `realnode.py`) that names its
owner's PID, and in one cgroup root (`/gpushare-<node>-<random>` in every cgroup hierarchy). Everything it starts
carries the folder on its command line (kubelet `--root-dir`, containerd `--config`, the shims' `-address`), every
mount it makes (overlay root filesystems, the sandboxes' /dev/shm, network namespaces, kubelet's volumes) lies
under the folder, and every container process lies in its cgroup root. So `cleanup` can end a node whose owner
crashed as well as one stopped in order: kill the processes in its cgroups and those naming its folder, unmount
what lies under the folder (deepest first), remove the cgroups (deepest first) and the folder.

    sweep_stale()   # at every start: the nodes whose owner process is gone
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

OWNER_FILE = "owner"  # in a node folder: "<pid> <process start time>" of the process that owns the node
CGROUP_FILE = "cgroup-root"  # in a node folder: the node's cgroup root, e.g. /gpushare-gpu-node-1-ab12cd34
MNT_DETACH = 2


NODES_DIR_ENV = "GPUSHARE_NODES_DIR"
NODE_FILE = "node"  # in a node folder: the node's name


def nodes_parent() -> Path:
    """The folder every local real node's folder is made in (`GPUSHARE_NODES_DIR`, else /tmp/gpushare-nodes: short,
    because containerd's shim sockets under a node's folder are named by a 64-character hash and a socket path has
    at most 108 bytes)."""
    return Path(os.environ.get(NODES_DIR_ENV) or "/tmp/gpushare-nodes")


def process_start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (the start time in clock ticks), '' when the process is gone: with the PID it
    names one process, whose PID may later be reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(folder: Path) -> bool:
    """Whether the process named in `folder/owner` still runs (False when the file is missing or unreadable)."""
    try:
        pid_text, started = (folder / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return False
    return process_start_time(int(pid_text)) == started


def write_owner(folder: Path) -> None:
    """Name this process as the owner of the node in `folder`."""
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {process_start_time(os.getpid())}\n")


@contextlib.contextmanager
def nodes_lock(parent: Path) -> Iterator[None]:
    """Hold `parent/.lock`: a node folder is made (with its owner) and stale ones are swept one at a time, across
    processes and threads, so a sweep never takes a folder whose owner is about to be written."""
    parent.mkdir(parents=True, exist_ok=True)
    with (parent / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def make_node_folder(name: str, parent: Path | None = None) -> Path:
    """A new folder for node `name` (`parent/<8 hex>`, its owner this process, its name in `node`)."""
    parent = parent or nodes_parent()
    with nodes_lock(parent):
        folder = parent / secrets.token_hex(4)
        folder.mkdir()
        write_owner(folder)
        (folder / NODE_FILE).write_text(name + "\n")
    return folder


def cgroup_mounts() -> list[Path]:
    """The mount points of every cgroup hierarchy (v1 controllers and the v2 unified one)."""
    out = []
    for line in _mountinfo():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] in ("cgroup", "cgroup2"):
            out.append(Path(_unescape(fields[4])))
    return out


def create_cgroup_root(root: str) -> list[Path]:
    """Make the cgroup `root` in every hierarchy (kubelet wants its `cgroupRoot` to exist); a new cpuset cgroup
    gets its parent's CPUs and memory nodes, without which no task may join it. Returns the folders made."""
    made = []
    for mount in cgroup_mounts():
        path = mount / root.strip("/")
        if path.is_dir():
            continue
        path.mkdir(parents=True)
        made.append(path)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (path / name).exists() and not (path / name).read_text().strip():
                (path / name).write_text((path.parent / name).read_text())
    return made


def _cgroup_dirs(root: str) -> list[Path]:
    """Every folder of cgroup `root` in every hierarchy, deepest first."""
    found: list[Path] = []
    for mount in cgroup_mounts():
        top = mount / root.strip("/")
        if top.is_dir():
            found += [Path(d) for d, _, _ in os.walk(top)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def cgroup_pids(root: str) -> set[int]:
    """The processes in cgroup `root` (any hierarchy, any depth)."""
    pids: set[int] = set()
    for folder in _cgroup_dirs(root):
        with contextlib.suppress(OSError, ValueError):
            pids |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
    return pids


def pids_naming(folder: Path) -> set[int]:
    """The processes whose command line names `folder` (or anything under it)."""
    marker = str(folder).encode()
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes():
                out.add(int(entry.name))
    return out


def rss_kib(pid: int) -> int:
    """A process's resident memory now (KiB; 0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each process (one that is already gone is skipped)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(probe: Callable[[], set[int]], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = probe()
        if not left or time.monotonic() > deadline:
            return left
        kill(left)
        time.sleep(0.05)


def mounts_under(folder: Path) -> list[Path]:
    """Mount points at or under `folder`, deepest first."""
    prefix = str(folder).rstrip("/") + "/"
    points = [Path(_unescape(line.split()[4])) for line in _mountinfo()]
    under = {p for p in points if str(p) == prefix[:-1] or str(p).startswith(prefix)}
    return sorted(under, key=lambda p: len(p.parts), reverse=True)


def unmount_under(folder: Path) -> list[str]:
    """Detach every mount under `folder` (deepest first, again until none is left); returns what failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    failed: dict[str, str] = {}
    for _ in range(5):
        points = mounts_under(folder)
        if not points:
            return []
        for point in points:
            if libc.umount2(str(point).encode(), MNT_DETACH) != 0:
                code = ctypes.get_errno()
                if code not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
                    failed[str(point)] = os.strerror(code)
    return [f"{p}: {e}" for p, e in failed.items()] or [str(p) for p in mounts_under(folder)]


def remove_cgroups(root: str) -> list[str]:
    """Remove cgroup `root` in every hierarchy, deepest first; returns the folders that stayed."""
    left = []
    for folder in _cgroup_dirs(root):
        for attempt in range(20):
            try:
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if attempt == 19:
                    left.append(str(folder))
                time.sleep(0.05)
    return left


def cleanup(folder: Path, cgroup_root: str | None = None) -> list[str]:
    """End everything of the node in `folder`: processes in its cgroups and naming the folder, mounts under it,
    its cgroups, the folder. Returns what could not be removed ([] when nothing is left)."""
    if cgroup_root is None:
        with contextlib.suppress(OSError):
            cgroup_root = (folder / CGROUP_FILE).read_text().strip() or None
    problems: list[str] = []
    left = _wait_gone(lambda: pids_naming(folder) | (cgroup_pids(cgroup_root) if cgroup_root else set()), 10.0)
    problems += [f"process {pid} still runs" for pid in sorted(left)]
    problems += unmount_under(folder)
    if cgroup_root:
        problems += remove_cgroups(cgroup_root)
    if not mounts_under(folder):  # never remove files through a mount that stayed
        shutil.rmtree(folder, ignore_errors=True)
    if folder.exists():
        problems.append(f"{folder} still exists")
    return problems


def sweep_stale(parent: Path | None = None, progress: Callable[[str], None] | None = None) -> list[Path]:
    """Clean up every node folder under `parent` whose owner process is gone (a test or `gpushare up` that was
    killed); returns the folders cleaned."""
    parent = parent or nodes_parent()
    swept: list[Path] = []
    if not parent.is_dir():
        return swept
    with nodes_lock(parent):
        for folder in sorted(p for p in parent.iterdir() if p.is_dir()):
            if owner_alive(folder):
                continue
            problems = cleanup(folder)
            swept.append(folder)
            if progress is not None:
                state = f"; left: {'; '.join(problems)}" if problems else ""
                progress(f"cleaned up the stale node {folder.name} (its owner is gone){state}")
    return swept


def _mountinfo() -> list[str]:
    try:
        return Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []


def _unescape(path: str) -> str:
    """A mountinfo path with its octal escapes (`\\040` for a space) decoded."""
    return path.encode().decode("unicode_escape") if "\\" in path else path
