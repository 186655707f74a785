"""CPU seconds spent by each part of the system during a phase, read from /proc (Linux).

Ratios say how fast; this says where the time goes. Only this benchmark's own processes count: the bench
process and everything it started (the control plane, the services), plus the PostgreSQL and NATS servers
it uses (found by their listening port) with their children. Other work on the machine is left out. Each
process is grouped by what its command line names (extender, binder, kube-apiserver, postgres, ...). A
process's time includes its reaped children's, so short-lived helpers (PostgreSQL backends) still count.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

GROUPS = (
    "extender",
    "binder",
    "accounting",
    "node-agent",
    "kube-apiserver",
    "etcd",
    "kube-scheduler",
    "kube-controller-manager",
    "nats-server",
    "postgres",
    "kubelet",  # real nodes (bench.realnode): kubelet, and containerd with the shims it starts
    "containerd",
)
# where they run in a deployment: the Kubernetes control plane, and what gpushare adds to it (its services and
# the servers they use); the product's CPU per pod is the sum of the second
CONTROL_PLANE_GROUPS = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager")
PRODUCT_GROUPS = ("extender", "binder", "accounting", "node-agent", "postgres", "nats-server")
# the part of the product that runs beside the control plane: the node agents run on the GPU nodes, one each
CENTRAL_GROUPS = tuple(g for g in PRODUCT_GROUPS if g != "node-agent")
# text in a command line -> its group, checked first (a benchmark's own programs: the seed's extender, whose
# name would read as gpushare's extender, and its kube-scheduler; `bench.peer` fills it in)
NAMED_PROGRAMS: dict[str, str] = {}


@dataclass(frozen=True)
class Proc:
    """A process as /proc shows it: its CPU seconds include its reaped children's."""

    pid: int
    ppid: int
    command: str
    cpu_s: float


def group_of(command: str, pid: int) -> str:
    """The part of the system a process belongs to ('bench' for this process, 'other' for the rest).

    A service is named by its subcommand (`... services.cli node-agent ...`), anything else by its program
    (the first word), so flags such as `--accounting-url` do not count.
    """
    if pid == os.getpid():
        return "bench"
    for marker, group in NAMED_PROGRAMS.items():
        if marker in command:
            return group
    words = command.split()
    if "devstack.stack.fleet" in words:  # many simulated nodes' agents (and kubelet stand-ins) in one process
        return "node-agent"
    if "services.cli" in words:
        at = words.index("services.cli")
        return words[at + 1] if at + 1 < len(words) else "other"
    program = os.path.basename(words[0]) if words else ""
    for name in GROUPS:
        if name in program:
            return name
    return "postgres" if program.startswith("postgres") or "postgres:" in command else "other"


def _processes() -> dict[int, Proc]:
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, Proc] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        cpu = sum(int(f) for f in fields[11:15]) / ticks  # utime, stime, cutime, cstime
        pid = int(entry.name)
        # a process that exited and is not reaped yet (a zombie) has no command line: its name in stat still says
        # what it was (CI: a PostgreSQL backend just closed, its CPU counted as "other")
        command = command.strip() or stat[stat.find("(") + 1 : stat.rfind(")")]
        out[pid] = Proc(pid, int(fields[1]), command, cpu)
    return out


def listener_pids(listeners: list[int | str]) -> list[int]:
    """PIDs of the processes listening on these TCP ports (IPv4 or IPv6) or unix socket paths, where /proc
    lets us see them."""
    ports = {x for x in listeners if isinstance(x, int)}
    paths = {x for x in listeners if isinstance(x, str)}
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) in ports:  # 0A: LISTEN
                inodes.add(cols[9])
    try:
        unix = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        unix = []
    for line in unix:  # Num RefCount Protocol Flags Type St Inode Path
        cols = line.split()
        if len(cols) > 7 and cols[7] in paths:
            inodes.add(cols[6])
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            pids.append(int(entry.name))
    return pids


def benchmark_roots(server_ports: list[int | str] | None = None) -> list[int]:
    """This process and the PostgreSQL / NATS servers listening there: the roots of the benchmark's trees."""
    return [os.getpid(), *listener_pids(server_ports or [])]


def tree(roots: list[int]) -> list[Proc]:
    """The processes of the trees under `roots` (each once), as they are now."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    seen: set[int] = set()
    todo = [r for r in roots if r in procs]
    out: list[Proc] = []
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(procs[pid])
        todo.extend(children.get(pid, ()))
    return out


def cpu_by_group(roots: list[int]) -> Counter[str]:
    """CPU seconds used so far by the process trees under `roots`, per group."""
    out: Counter[str] = Counter()
    for p in tree(roots):
        out[group_of(p.command, p.pid)] += p.cpu_s
    return out


def ms_per_item(spent: dict[str, float], items: int, prefix: str) -> dict[str, float]:
    """`{prefix}_cpu_ms_per_pod_{group}` for every group that used CPU (seconds in `spent`), plus the total."""
    used = {g: s for g, s in spent.items() if s > 0}
    out = {f"{prefix}_cpu_ms_per_pod_{g.replace('-', '_')}": round(s * 1000 / items, 2) for g, s in used.items()}
    out[f"{prefix}_cpu_ms_per_pod_total"] = round(sum(used.values()) * 1000 / items, 2)
    return out


def background_ms_per_item(
    idle: dict[str, float], idle_s: float, busy_s: float, items: int, prefix: str
) -> dict[str, float]:
    """What the system spends with nothing to do (CPU seconds per group over `idle_s` of an idle window),
    spread over a phase of `busy_s` seconds and `items` pods: the part of that phase's CPU per pod that is
    background (leases, probes, periodic loops) rather than the pods' own work. Totals for the control plane,
    for gpushare (`PRODUCT_GROUPS`) and for everything, as `{prefix}_background_cpu_ms_per_pod_*`."""
    scale = busy_s / idle_s * 1000 / items if idle_s > 0 and items > 0 else 0.0
    parts = {
        "control_plane": sum(idle.get(g, 0.0) for g in CONTROL_PLANE_GROUPS),
        "product": sum(idle.get(g, 0.0) for g in PRODUCT_GROUPS),
        "total": sum(idle.values()),
    }
    return {f"{prefix}_background_cpu_ms_per_pod_{k}": round(v * scale, 2) for k, v in parts.items()}


def product_ms_per_pod(metrics: dict[str, float], prefix: str, groups: tuple[str, ...] = PRODUCT_GROUPS) -> float:
    """gpushare's own CPU per pod: the sum of the groups' `{prefix}_cpu_ms_per_pod_*` figures (by default every
    part of the product; `CENTRAL_GROUPS` leaves out the node agents)."""
    keys = (f"{prefix}_cpu_ms_per_pod_{g.replace('-', '_')}" for g in groups)
    return round(sum(metrics.get(k, 0.0) for k in keys), 2)


class CpuWindow:
    """`with CpuWindow(server_ports) as w: ...` then `w.per_item_ms(n, prefix)`: CPU ms per item per group."""

    def __init__(self, server_ports: list[int | str] | None = None) -> None:
        self.roots = benchmark_roots(server_ports)

    def __enter__(self) -> CpuWindow:
        self.before = cpu_by_group(self.roots)
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = cpu_by_group(self.roots)
        self.seconds = time.monotonic() - self.started

    def spent(self) -> dict[str, float]:
        """CPU seconds per group inside the window."""
        return {g: max(0.0, self.after[g] - self.before.get(g, 0.0)) for g in self.after}

    def per_item_ms(self, items: int, prefix: str) -> dict[str, float]:
        """`{prefix}_cpu_ms_per_pod_{group}` for every group that used CPU, plus the total."""
        return ms_per_item(self.spent(), items, prefix)
