"""The NVML backend (`pynvml`, from the `nvidia-ml-py` package)."""

from __future__ import annotations

import logging
import time
from typing import Any

from services.node_agent.discovery import GpuDevice, HealthChange, NoGpuBackend, ProcessUsage

log = logging.getLogger(__name__)

# XIDs caused by applications, not by the GPU (the NVIDIA device plugin skips the same ones).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
RECOVER_AFTER_S = 60.0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """GPUs through NVML. XID critical errors mark a GPU unhealthy; it is reported healthy again once
    it answers NVML queries and `RECOVER_AFTER_S` passed without a further critical XID."""

    def __init__(self, recover_after_s: float = RECOVER_AFTER_S) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - the dependency is declared
            raise NoGpuBackend(f"pynvml is not installed ({exc}); install nvidia-ml-py or pass --fake-gpus") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpuBackend(
                f"NVML is not available ({exc}): run on a node with the NVIDIA driver, or pass --fake-gpus"
            ) from None
        self.recover_after_s = recover_after_s
        self._sm_seen: dict[str, int] = {}  # GPU -> CPU timestamp (µs) of the newest per-process sample read
        self._sm_unsupported: set[str] = set()
        self._events: Any = None
        self._unhealthy_since: dict[str, float] = {}
        self._handles = self._load_handles()
        self._register_events()

    def _load_handles(self) -> dict[str, Any]:
        n = self.nvml
        return {
            _text(n.nvmlDeviceGetUUID(h)): h
            for h in (n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount()))
        }

    def _register_events(self) -> None:
        n = self.nvml
        try:
            self._events = n.nvmlEventSetCreate()
        except n.NVMLError as exc:
            log.warning("NVML events unavailable (%s): XID health checks disabled", exc)
            return
        for gpu_uuid, handle in self._handles.items():
            try:
                n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, self._events)
            except n.NVMLError as exc:
                log.warning("cannot watch XID errors on %s (%s)", gpu_uuid, exc)

    def devices(self) -> list[GpuDevice]:
        """Every GPU with its identity, memory, MIG mode and PCI / NUMA placement."""
        n = self.nvml
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            try:
                mig = bool(n.nvmlDeviceGetMigMode(h)[0])
            except n.NVMLError:
                mig = False
            pci = n.nvmlDeviceGetPciInfo(h)
            bus_id = _text(getattr(pci, "busId", "") or getattr(pci, "busIdLegacy", ""))
            out.append(
                GpuDevice(
                    index=i,
                    uuid=_text(n.nvmlDeviceGetUUID(h)),
                    model=_text(n.nvmlDeviceGetName(h)),
                    memory_total_mib=int(n.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)),
                    mig_mode=mig,
                    pci_bus_id=bus_id,
                    numa_node=_numa_node(bus_id),
                )
            )
        return out

    def versions(self) -> tuple[str, str]:
        """Driver version and CUDA driver version (`12.4`)."""
        n = self.nvml
        driver = _text(n.nvmlSystemGetDriverVersion())
        try:
            cuda = n.nvmlSystemGetCudaDriverVersion()
            cuda_text = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        except n.NVMLError:
            cuda_text = ""
        return driver, cuda_text

    def wait_health(self, timeout_s: float) -> list[HealthChange]:
        """XID critical errors seen within `timeout_s`, plus recoveries that became due."""
        n = self.nvml
        changes: list[HealthChange] = []
        if self._events is not None:
            try:
                data = n.nvmlEventSetWait(self._events, int(timeout_s * 1000))
                xid = int(data.eventData)
                gpu_uuid = _text(n.nvmlDeviceGetUUID(data.device))
                if data.eventType == n.nvmlEventTypeXidCriticalError and xid not in APPLICATION_XIDS:
                    first = gpu_uuid not in self._unhealthy_since
                    self._unhealthy_since[gpu_uuid] = time.monotonic()
                    if first:
                        changes.append(HealthChange(gpu_uuid, False, f"XID {xid} critical error"))
            except n.NVMLError as exc:
                if "Timeout" not in type(exc).__name__ and "timeout" not in str(exc).lower():
                    log.debug("NVML event wait: %s", exc)
        else:
            time.sleep(timeout_s)
        now = time.monotonic()
        for gpu_uuid, since in list(self._unhealthy_since.items()):
            if now - since >= self.recover_after_s and self._answers(gpu_uuid):
                del self._unhealthy_since[gpu_uuid]
                changes.append(HealthChange(gpu_uuid, True, "no critical XID since recovery delay; NVML answers"))
        return changes

    def _answers(self, gpu_uuid: str) -> bool:
        handle = self._handles.get(gpu_uuid)
        if handle is None:
            return False
        try:
            self.nvml.nvmlDeviceGetMemoryInfo(handle)
            return True
        except self.nvml.NVMLError:
            return False

    def processes(self) -> list[ProcessUsage]:
        """Compute processes per GPU (host PIDs: needs hostPID for the cgroup mapping)."""
        n = self.nvml
        out = []
        for gpu_uuid, h in self._handles.items():
            try:
                procs = n.nvmlDeviceGetComputeRunningProcesses(h)
            except n.NVMLError as exc:
                log.debug("no process list for %s: %s", gpu_uuid, exc)
                continue
            for p in procs:
                used = p.usedGpuMemory
                mib = int(used // (1024 * 1024)) if isinstance(used, int) and used >= 0 else 0
                out.append(ProcessUsage(pid=int(p.pid), gpu_uuid=gpu_uuid, used_memory_mib=mib))
        return out

    def utilization(self) -> dict[str, float]:
        """GPU utilisation percent per GPU."""
        n = self.nvml
        out = {}
        for gpu_uuid, h in self._handles.items():
            try:
                out[gpu_uuid] = float(n.nvmlDeviceGetUtilizationRates(h).gpu)
            except n.NVMLError:
                continue
        return out

    def process_utilization(self) -> dict[str, dict[int, float]]:
        """Per GPU, each process's SM utilisation (percent of the GPU) since the previous call, from NVML's
        per-process samples (`nvmlDeviceGetProcessUtilization`, from the timestamp of the newest sample read
        before). A GPU that cannot say (not supported, e.g. MIG or a pre-Maxwell GPU) is left out."""
        n = self.nvml
        out: dict[str, dict[int, float]] = {}
        for gpu_uuid, h in self._handles.items():
            since = self._sm_seen.get(gpu_uuid, 0)
            try:
                samples = n.nvmlDeviceGetProcessUtilization(h, since)
            except n.NVMLError as exc:
                if _is_not_found(n, exc):  # no process had SM activity since `since`: every process idled
                    out[gpu_uuid] = {}
                elif gpu_uuid not in self._sm_unsupported:
                    self._sm_unsupported.add(gpu_uuid)
                    log.warning("no per-process SM utilisation on GPU %s (%s): pods there show none", gpu_uuid, exc)
                continue
            self._sm_unsupported.discard(gpu_uuid)
            by_pid, newest = process_sm(samples, since)
            self._sm_seen[gpu_uuid] = max(since, newest)
            out[gpu_uuid] = by_pid
        return out

    def close(self) -> None:
        """Shut NVML down."""
        n = self.nvml
        try:
            if self._events is not None:
                n.nvmlEventSetFree(self._events)
            n.nvmlShutdown()
        except n.NVMLError:
            pass


def process_sm(samples: Any, since: int) -> tuple[dict[int, float], int]:
    """NVML's per-process utilisation samples (`pid`, `timeStamp` in µs, `smUtil` in percent) -> (PID -> mean SM
    percent of its samples newer than `since`, the newest timestamp). The driver keeps several samples per process
    (one per sampling period), and may return ones read before: those are skipped."""
    sums: dict[int, list[float]] = {}
    newest = since
    for sample in samples:
        stamp = int(sample.timeStamp)
        if stamp <= since:
            continue
        newest = max(newest, stamp)
        acc = sums.setdefault(int(sample.pid), [0.0, 0.0])
        acc[0] += min(max(float(sample.smUtil), 0.0), 100.0)
        acc[1] += 1
    return {pid: total / count for pid, (total, count) in sums.items()}, newest


def _is_not_found(nvml: Any, exc: Exception) -> bool:
    """NVML_ERROR_NOT_FOUND: the per-process query found no sample since the timestamp given."""
    return getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_FOUND", 6)


def _numa_node(bus_id: str) -> int | None:
    """The NUMA node of a PCI device from sysfs (None when unknown)."""
    if not bus_id:
        return None
    short = bus_id.lower()[-12:] if len(bus_id) > 12 else bus_id.lower()
    for candidate in (bus_id.lower(), short, f"0000{short[4:]}" if len(short) == 12 else short):
        try:
            with open(f"/sys/bus/pci/devices/{candidate}/numa_node") as f:
                value = int(f.read().strip())
            return value if value >= 0 else None
        except (OSError, ValueError):
            continue
    return None
