"""What GPUs a node has: the backend protocol, the device model, and the fake backend.

Everything above this module (inventory, device plugin, health, usage) talks to a `GpuBackend`, so the
fake backend (`--fake-gpus "2x16GiB:Tesla-T4,1x80GiB:A100"`) drives exactly the code NVML drives.
Backend calls are blocking (NVML is a C library); the agent runs them in a worker thread.
"""

from __future__ import annotations

import re
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Protocol

from shared.settings import MemoryUnit

_UUID_NAMESPACE = uuid.UUID("7d4f1d52-6c1f-4f8e-9a53-2b1b3f0f6a11")


class NoGpuBackend(SystemExit):
    """Neither NVML nor `--fake-gpus` is available: the agent cannot run."""


@dataclass(frozen=True)
class GpuDevice:
    """One physical GPU as discovered."""

    index: int
    uuid: str
    model: str
    memory_total_mib: int
    mig_mode: bool = False
    pci_bus_id: str = ""
    numa_node: int | None = None


@dataclass(frozen=True)
class HealthChange:
    """A GPU became unhealthy (e.g. an XID critical error) or recovered."""

    gpu_uuid: str
    healthy: bool
    reason: str = ""


@dataclass(frozen=True)
class ProcessUsage:
    """GPU memory one host process holds on one GPU."""

    pid: int
    gpu_uuid: str
    used_memory_mib: int


class GpuBackend(Protocol):
    """Access to the node's GPUs (NVML or fake)."""

    def devices(self) -> list[GpuDevice]:
        """Every GPU, ordered by index."""
        ...

    def versions(self) -> tuple[str, str]:
        """(driver version, CUDA driver version as `12.4`)."""
        ...

    def wait_health(self, timeout_s: float) -> list[HealthChange]:
        """Block up to `timeout_s` for health changes; return them (empty on timeout)."""
        ...

    def processes(self) -> list[ProcessUsage]:
        """Compute processes on every GPU with the memory each holds."""
        ...

    def utilization(self) -> dict[str, float]:
        """GPU UUID -> utilisation percent (0..100) over the last sample period."""
        ...

    def close(self) -> None:
        """Release the library."""
        ...


def schedulable_mib(total_mib: int, unit: MemoryUnit) -> int:
    """Physical memory rounded down to whole resource units (in MiB)."""
    return (max(total_mib, 0) // unit.mib) * unit.mib


def fake_uuid(node: str, index: int) -> str:
    """A stable GPU UUID derived from the node name and index (restarts keep identity)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


_SPEC_ITEM = re.compile(r"^\s*(?:(\d+)\s*[xX]\s*)?(\d+)\s*(GiB|GB|G|MiB|MB|M)\s*(?::\s*(.+?))?\s*$")


def parse_fake_gpus(spec: str, node: str) -> list[GpuDevice]:
    """Parse `COUNTxMEM[GiB|MiB][:MODEL],...` (count defaults to 1, model to `Fake-GPU`).

    Raises ValueError naming the bad item.
    """
    if not spec or not spec.strip():
        raise ValueError("empty --fake-gpus specification (example: 2x16GiB:Tesla-T4,1x80GiB:A100)")
    devices: list[GpuDevice] = []
    for item in spec.split(","):
        m = _SPEC_ITEM.match(item)
        if m is None:
            raise ValueError(
                f"bad --fake-gpus item {item.strip()!r}: expected COUNTxMEM(GiB|MiB)[:MODEL], e.g. 2x16GiB:T4"
            )
        count = int(m.group(1) or 1)
        amount = int(m.group(2))
        mib = amount * 1024 if m.group(3).upper().startswith("G") else amount
        if count < 1 or count > 64 or mib < 1:
            raise ValueError(f"bad --fake-gpus item {item.strip()!r}: count must be 1..64 and memory positive")
        model = (m.group(4) or "Fake-GPU").strip()
        for _ in range(count):
            index = len(devices)
            devices.append(
                GpuDevice(
                    index=index,
                    uuid=fake_uuid(node, index),
                    model=model,
                    memory_total_mib=mib,
                    pci_bus_id=f"00000000:{index + 1:02X}:00.0",
                    numa_node=0,
                )
            )
    if len(devices) > 256:
        raise ValueError("--fake-gpus describes more than 256 GPUs")
    return devices


@dataclass
class FakeBackend:
    """A backend from a `--fake-gpus` specification; tests drive health and processes through it."""

    node: str
    spec: str
    driver_version: str = "fake-550.00"
    cuda_version: str = "12.4"
    _devices: list[GpuDevice] = field(init=False)
    _health: list[HealthChange] = field(default_factory=list, init=False)
    _processes: list[ProcessUsage] = field(default_factory=list, init=False)
    _utilization: dict[str, float] = field(default_factory=dict, init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False)

    def __post_init__(self) -> None:
        self._devices = parse_fake_gpus(self.spec, self.node)

    def devices(self) -> list[GpuDevice]:
        """The configured GPUs."""
        with self._cond:
            return list(self._devices)

    def versions(self) -> tuple[str, str]:
        """Fixed fake versions."""
        return self.driver_version, self.cuda_version

    def wait_health(self, timeout_s: float) -> list[HealthChange]:
        """Changes queued by `set_health`."""
        with self._cond:
            if not self._health:
                self._cond.wait(timeout_s)
            out, self._health = self._health, []
            return out

    def processes(self) -> list[ProcessUsage]:
        """Processes set by `set_processes`."""
        with self._cond:
            return list(self._processes)

    def utilization(self) -> dict[str, float]:
        """Utilisation set by `set_processes`."""
        with self._cond:
            return dict(self._utilization)

    def close(self) -> None:
        """Nothing to release."""

    # -- test / development controls ---------------------------------------------------------
    def set_health(self, gpu_uuid: str, healthy: bool, reason: str = "") -> None:
        """Simulate an XID error (healthy=False) or a recovery."""
        with self._cond:
            self._health.append(HealthChange(gpu_uuid, healthy, reason or ("recovered" if healthy else "fake XID 79")))
            self._cond.notify_all()

    def set_processes(self, processes: list[ProcessUsage], utilization: dict[str, float] | None = None) -> None:
        """Simulate the processes running on the GPUs."""
        with self._cond:
            self._processes = list(processes)
            self._utilization = dict(utilization or {})

    def set_memory(self, index: int, memory_total_mib: int) -> None:
        """Simulate a changed GPU (for inventory-change tests)."""
        with self._cond:
            self._devices[index] = replace(self._devices[index], memory_total_mib=memory_total_mib)
