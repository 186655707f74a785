"""CPU seconds spent by each part of the system during a phase, read from /proc (Linux).

Ratios say how fast; this says where the time goes. Processes are grouped by what their command line
names (extender, binder, kube-apiserver, postgres, ...); the benchmark process itself is `bench`.
"""

from __future__ import annotations

import os
from collections import Counter
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
)


def group_of(command: str, pid: int) -> str:
    """The part of the system a process belongs to ('bench' for this process, 'other' for the rest)."""
    if pid == os.getpid():
        return "bench"
    for name in GROUPS:
        if name in command:
            return name
    return "other"


def cpu_by_group() -> Counter[str]:
    """CPU seconds (user + system) used so far by each group's live processes."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: Counter[str] = Counter()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[group_of(command, int(entry.name))] += (int(fields[11]) + int(fields[12])) / ticks
    return out


class CpuWindow:
    """`with CpuWindow() as w: ...` then `w.per_item_ms(n)`: CPU milliseconds per item for each group."""

    def __enter__(self) -> CpuWindow:
        self.before = cpu_by_group()
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = cpu_by_group()

    def spent(self) -> dict[str, float]:
        """CPU seconds per group inside the window (groups whose processes lived throughout)."""
        return {
            g: self.after[g] - self.before.get(g, 0.0) for g in self.after if self.after[g] > self.before.get(g, 0.0)
        }

    def per_item_ms(self, items: int, prefix: str) -> dict[str, float]:
        """`{prefix}_cpu_ms_per_pod_{group}` for every group that used CPU, plus the total."""
        spent = self.spent()
        out = {f"{prefix}_cpu_ms_per_pod_{g.replace('-', '_')}": round(s * 1000 / items, 2) for g, s in spent.items()}
        out[f"{prefix}_cpu_ms_per_pod_total"] = round(sum(spent.values()) * 1000 / items, 2)
        return out
