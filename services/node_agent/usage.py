"""Usage sampling core: host PIDs -> pod UIDs through `/proc/<pid>/cgroup`, samples per pod and GPU,
and the over-use tracker (a pod using more than it was allocated for longer than a grace period)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.node_agent.assignment import PendingContainer
from services.node_agent.discovery import GpuDevice, ProcessUsage
from shared.events.catalogue import MAX_MIB, UsageSample
from shared.metrics import gpu_labels, percent_to_ratio

# cgroupfs: .../pod<uid>/<container>; systemd: ...-pod<uid with _>.slice/...
_POD_UID = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")


def pod_uid_from_cgroup(text: str) -> str:
    """The pod UID named in a `/proc/<pid>/cgroup` file's text ("" when the process is not in a pod)."""
    for line in text.splitlines():
        m = _POD_UID.search(line)
        if m:
            return m.group(1).replace("_", "-").lower()
    return ""


def pid_to_pod_uid(proc_root: Path) -> Callable[[int], str]:
    """A lookup reading `<proc_root>/<pid>/cgroup` (unreadable -> "")."""

    def lookup(pid: int) -> str:
        try:
            return pod_uid_from_cgroup((proc_root / str(pid) / "cgroup").read_text())
        except OSError:
            return ""

    return lookup


def build_samples(
    processes: Iterable[ProcessUsage],
    utilization: dict[str, float],
    pod_of_pid: Callable[[int], str],
    containers: Iterable[PendingContainer],
    process_sm: dict[str, dict[int, float]] | None = None,
) -> list[UsageSample]:
    """One sample per (GPU, pod) with the memory its processes hold and the SMs they kept busy; processes outside
    pods are summed under an empty pod UID. The container is named when the pod has one container on that GPU.

    `process_sm` (GPU -> {PID: SM percent}, the backend's `process_utilization`) is attributed to pods the way
    memory is, through each PID's cgroup; a GPU it does not name gets no SM figure (None), a process it does not
    list on a GPU it names was idle (0)."""
    by_pod: dict[str, list[PendingContainer]] = {}
    for c in containers:
        by_pod.setdefault(c.pod_uid, []).append(c)
    sm_known = process_sm or {}
    used: dict[tuple[str, str], int] = {}
    busy: dict[tuple[str, str], float] = {}
    for p in processes:
        key = (p.gpu_uuid, pod_of_pid(p.pid))
        used[key] = used.get(key, 0) + p.used_memory_mib
    for gpu, by_pid in sm_known.items():
        for pid, pct in by_pid.items():
            key = (gpu, pod_of_pid(pid))
            busy[key] = busy.get(key, 0.0) + pct
            used.setdefault(key, 0)  # SM activity without memory in NVML's list (it ended since): still the pod's
    samples = []
    for (gpu, pod_uid), mib in sorted(used.items()):
        known = by_pod.get(pod_uid, [])
        on_gpu = [c for c in known if any(s.gpu_uuid == gpu for s in c.shares) and c.long_running]
        sm = min(max(busy.get((gpu, pod_uid), 0.0), 0.0), 100.0) if gpu in sm_known else None
        samples.append(
            UsageSample(
                gpu_uuid=gpu,
                pod_uid=pod_uid,
                namespace=known[0].namespace if known else "",
                pod_name=known[0].pod_name if known else "",
                container=on_gpu[0].container if len(on_gpu) == 1 else "",
                used_memory_mib=min(mib, MAX_MIB),
                utilization_pct=min(max(utilization.get(gpu, 0.0), 0.0), 100.0),
                sm_utilization_pct=sm,
            )
        )
    return samples


def pod_sm_series(node: str, gpus: Iterable[GpuDevice], samples: Iterable[UsageSample]) -> dict[tuple[str, ...], float]:
    """The per-pod SM gauge's series (pure): dcgm-exporter's GPU labels, namespace, pod and container -> the ratio
    of the GPU's SMs the pod's processes kept busy. Only pods' samples with an SM figure; processes outside pods and
    GPUs that cannot say are left out."""
    by_uuid = {g.uuid: g for g in gpus}
    out: dict[tuple[str, ...], float] = {}
    for s in samples:
        if not s.pod_uid or s.sm_utilization_pct is None:
            continue
        g = by_uuid.get(s.gpu_uuid)
        labels = (
            *gpu_labels(node, g.index if g else -1, s.gpu_uuid, g.model if g else ""),
            s.namespace,
            s.pod_name or s.pod_uid,
            s.container,
        )
        out[labels] = out.get(labels, 0.0) + percent_to_ratio(s.sm_utilization_pct)
    return out


def allocated_by_pod_gpu(containers: Iterable[PendingContainer]) -> dict[tuple[str, str], int]:
    """(pod UID, GPU UUID) -> MiB allocated to the pod's app containers and sidecars there."""
    out: dict[tuple[str, str], int] = {}
    for c in containers:
        if not c.long_running:
            continue
        for s in c.shares:
            out[(c.pod_uid, s.gpu_uuid)] = out.get((c.pod_uid, s.gpu_uuid), 0) + s.memory_mib
    return out


@dataclass
class OveruseTracker:
    """Remembers since when each (pod, GPU) uses more than allocated; reports episodes past the grace.

    A pod process on a GPU where the pod holds no share at all counts as using more than nothing: it is reported
    with allocated None (the GPU was reached around the device plugin), never skipped. Processes outside pods
    (empty pod UID: the host's own, such as monitoring agents) are not judged."""

    grace_s: float
    since: dict[tuple[str, str], float] = field(default_factory=dict)
    reported: set[tuple[str, str]] = field(default_factory=set)

    def update(
        self, samples: Iterable[UsageSample], allocated: dict[tuple[str, str], int], now: float
    ) -> list[tuple[UsageSample, int | None]]:
        """Feed one round of samples; returns (sample, allocated MiB, None where the pod holds nothing on that
        GPU) for newly reportable episodes."""
        over_now = set()
        fresh: list[tuple[UsageSample, int | None]] = []
        for s in samples:
            if not s.pod_uid:
                continue
            key = (s.pod_uid, s.gpu_uuid)
            limit = allocated.get(key)
            if s.used_memory_mib <= (limit or 0):
                continue
            over_now.add(key)
            start = self.since.setdefault(key, now)
            if now - start >= self.grace_s and key not in self.reported:
                self.reported.add(key)
                fresh.append((s, limit))
        for key in list(self.since):
            if key not in over_now:
                del self.since[key]
                self.reported.discard(key)
        return fresh

    def over(self) -> set[tuple[str, str]]:
        """(pod, GPU) pairs currently past the grace period."""
        return set(self.reported)
