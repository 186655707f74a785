"""What GPUs a node has: the backend protocol, the device model, and the fake backend.

Everything above this module (inventory, device plugin, health, usage) talks to a `GpuBackend`, so the
fake backend (`--fake-gpus "2x16GiB:Tesla-T4,1x80GiB:A100"`) drives exactly the code NVML drives.
Backend calls are blocking (NVML is a C library); the agent runs them in a worker thread.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from services.node_agent.assignment import PendingContainer
from services.node_agent.simulation import (
    ProfileError,
    Rule,
    SimulatedProcess,
    UsageSimulation,
    parse_rules,
    sm_percent,
    utilization,
)
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

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

    def process_utilization(self) -> dict[str, dict[int, float]]:
        """GPU UUID -> {host PID: percent of the GPU's SMs the process kept busy} since the previous call; a
        process missing from its GPU's map was idle, a GPU missing from the result cannot say."""
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


def nvidia_gpus_present(dev: Path = Path("/dev"), proc: Path = Path("/proc")) -> str:
    """What shows that this machine has NVIDIA GPUs (a device node or the driver's GPU list), "" when nothing.

    Simulated usage refuses to run where this finds something: made-up usage must never be reported for a
    node with real GPUs."""
    nodes = sorted(p.name for p in dev.glob("nvidia[0-9]*")) if dev.is_dir() else []
    if nodes:
        return f"{dev / nodes[0]} exists"
    gpus = proc / "driver" / "nvidia" / "gpus"
    if gpus.is_dir() and any(gpus.iterdir()):
        return f"{gpus} lists GPUs"
    return ""


class UsageRules:
    """The rules of `--simulate-usage`: inline (`PATTERN=SHAPE;...`) or `@FILE`, re-read when the file changes.

    A file that cannot be read or parsed keeps the rules in force and logs why (once per change)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip()
        self.path = Path(self.spec[1:]).expanduser() if self.spec.startswith("@") else None
        self._stamp: tuple[int, int] | None = None
        self.rules: list[Rule] = []
        if self.path is None:
            self.rules = parse_rules(self.spec)
        elif not self.path.is_file():
            raise ProfileError(f"--simulate-usage file {self.path} does not exist")
        else:
            self.rules = parse_rules(self.path.read_text())
            self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def current(self) -> list[Rule]:
        """The rules now (a changed file is parsed again)."""
        if self.path is None:
            return self.rules
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return self.rules
        self._stamp = stamp
        try:
            self.rules = parse_rules(self.path.read_text())
        except (OSError, UnicodeDecodeError, ProfileError) as exc:
            log.error("simulated usage: keeping the previous rules, %s cannot be used: %s", self.path, exc)
            return self.rules
        log.info("simulated usage rules changed: %s", "; ".join(map(str, self.rules)) or "(none)")
        return self.rules


@dataclass
class FakeBackend:
    """A backend from a `--fake-gpus` specification; tests drive health and processes through it.

    With `simulate` (the `--simulate-usage` rules) it also runs simulated workloads for the containers `attach`
    says the node runs, writing each simulated process's `<proc_root>/<pid>/cgroup` so the agent maps it to
    its pod like a real one."""

    node: str
    spec: str
    driver_version: str = "fake-550.00"
    cuda_version: str = "12.4"
    simulate: str | None = None
    proc_root: Path | None = None
    clock: Callable[[], float] = time.monotonic
    _devices: list[GpuDevice] = field(init=False)
    _health: list[HealthChange] = field(default_factory=list, init=False)
    _processes: list[ProcessUsage] = field(default_factory=list, init=False)
    _utilization: dict[str, float] = field(default_factory=dict, init=False)
    _process_sm: dict[str, dict[int, float]] | None = field(default=None, init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False)

    def __post_init__(self) -> None:
        self._devices = parse_fake_gpus(self.spec, self.node)
        self.rules = UsageRules(self.simulate) if self.simulate else None
        if self.rules is not None and self.proc_root is None:
            raise ValueError("simulated usage needs a folder for its processes' cgroup files (proc_root)")
        self.simulation = UsageSimulation(self.rules.current()) if self.rules else None
        self._containers: Callable[[], list[PendingContainer]] = list
        self._simulated: list[SimulatedProcess] = []
        self._written: set[int] = set()

    def attach(self, containers: Callable[[], list[PendingContainer]]) -> None:
        """Where the simulated workloads find the node's containers (the agent's view)."""
        self._containers = containers

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
        """Processes set by `set_processes`, and the simulated workloads' processes of this moment."""
        with self._cond:
            out = list(self._processes)
            if self.simulation is not None and self.rules is not None:
                self.simulation.rules = self.rules.current()
                self._simulated = self.simulation.step(self._containers(), self.clock())
                self._write_cgroups()
                out += [ProcessUsage(p.pid, p.gpu_uuid, p.used_memory_mib) for p in self._simulated]
            return out

    def utilization(self) -> dict[str, float]:
        """Utilisation set by `set_processes`, plus the simulated workloads' (as of the last `processes`)."""
        with self._cond:
            memory = {d.uuid: d.memory_total_mib for d in self._devices}
            out = dict(self._utilization)
            for gpu, pct in utilization(self._simulated, memory).items():
                out[gpu] = min(100.0, out.get(gpu, 0.0) + pct)
            return out

    def process_utilization(self) -> dict[str, dict[int, float]]:
        """SM utilisation per process set by `set_processes` (the GPUs it names answer; without `process_sm`
        every GPU answers with no busy process), plus the simulated workloads' (as of the last `processes`)."""
        with self._cond:
            out: dict[str, dict[int, float]] = (
                {gpu: dict(by_pid) for gpu, by_pid in self._process_sm.items()}
                if self._process_sm is not None
                else {d.uuid: {} for d in self._devices}
            )
            memory = {d.uuid: d.memory_total_mib for d in self._devices}
            for p in self._simulated:
                out.setdefault(p.gpu_uuid, {})[p.pid] = sm_percent(p, memory.get(p.gpu_uuid, 0))
            return out

    def _write_cgroups(self) -> None:
        """`<proc_root>/<pid>/cgroup` of each simulated process; the folders of ended ones are removed."""
        assert self.proc_root is not None
        now = {p.pid: p for p in self._simulated}
        for pid in self._written - now.keys():
            shutil.rmtree(self.proc_root / str(pid), ignore_errors=True)
        for pid in now.keys() - self._written:
            folder = self.proc_root / str(pid)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "cgroup").write_text(now[pid].cgroup)
        self._written = set(now)

    def close(self) -> None:
        """Remove the simulated processes' cgroup files."""
        with self._cond:
            if self.proc_root is not None:
                for pid in self._written:
                    shutil.rmtree(self.proc_root / str(pid), ignore_errors=True)
            self._written = set()

    # -- test / development controls ---------------------------------------------------------
    def set_health(self, gpu_uuid: str, healthy: bool, reason: str = "") -> None:
        """Simulate an XID error (healthy=False) or a recovery."""
        with self._cond:
            self._health.append(HealthChange(gpu_uuid, healthy, reason or ("recovered" if healthy else "fake XID 79")))
            self._cond.notify_all()

    def set_processes(
        self,
        processes: list[ProcessUsage],
        utilization: dict[str, float] | None = None,
        process_sm: dict[str, dict[int, float]] | None = None,
    ) -> None:
        """Simulate the processes running on the GPUs (`process_sm`: GPU -> {PID: SM percent}; a GPU it leaves out
        cannot say, as NVML's per-process query on a GPU that does not support it)."""
        with self._cond:
            self._processes = list(processes)
            self._utilization = dict(utilization or {})
            self._process_sm = None if process_sm is None else {g: dict(by_pid) for g, by_pid in process_sm.items()}

    def set_memory(self, index: int, memory_total_mib: int) -> None:
        """Simulate a changed GPU (for inventory-change tests)."""
        with self._cond:
            self._devices[index] = replace(self._devices[index], memory_total_mib=memory_total_mib)
