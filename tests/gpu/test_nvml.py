"""NVML discovery on a real GPU: runs where pynvml finds one, skips with the reason otherwise."""

from __future__ import annotations

import pytest

from services.node_agent.discovery import NoGpuBackend, schedulable_mib
from shared.settings import MemoryUnit


@pytest.fixture(scope="module")
def nvml():  # type: ignore[no-untyped-def]
    from services.node_agent.nvml import NvmlBackend

    try:
        backend = NvmlBackend()
    except NoGpuBackend as exc:
        pytest.skip(f"no NVIDIA GPU here: {exc}")
    if not backend.devices():
        backend.close()
        pytest.skip("NVML works but reports no GPU")
    yield backend
    backend.close()


def test_discovery(nvml) -> None:  # type: ignore[no-untyped-def]
    devices = nvml.devices()
    assert [d.index for d in devices] == list(range(len(devices)))
    for d in devices:
        assert d.uuid.startswith(("GPU-", "MIG-")) and d.model
        assert d.memory_total_mib > 1024
        assert schedulable_mib(d.memory_total_mib, MemoryUnit.GIB) <= d.memory_total_mib
        assert d.pci_bus_id
    driver, cuda = nvml.versions()
    assert driver and cuda.count(".") == 1


def test_health_usage_and_utilization(nvml) -> None:  # type: ignore[no-untyped-def]
    uuids = {d.uuid for d in nvml.devices()}
    changes = nvml.wait_health(0.2)
    assert all(c.gpu_uuid in uuids for c in changes)
    assert set(nvml.utilization()) <= uuids
    for p in nvml.processes():
        assert p.gpu_uuid in uuids and p.used_memory_mib >= 0 and p.pid > 0


def test_per_process_sm_utilization(nvml) -> None:  # type: ignore[no-untyped-def]
    uuids = {d.uuid for d in nvml.devices()}
    first = nvml.process_utilization()
    again = nvml.process_utilization()  # from the newest timestamp read: older samples are not counted twice
    for reading in (first, again):
        assert set(reading) <= uuids
        for by_pid in reading.values():
            assert all(pid > 0 and 0.0 <= pct <= 100.0 for pid, pct in by_pid.items())
