"""Pure pieces: --fake-gpus parsing, schedulable memory, device IDs, matching, labels, cgroups, over-use."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services.node_agent.assignment import (
    AssignmentError,
    PendingContainer,
    Share,
    container_env,
    device_id,
    gpu_of,
    match_container,
    preferred_devices,
)
from services.node_agent.discovery import fake_uuid, parse_fake_gpus, schedulable_mib
from services.node_agent.labels import node_labels, short_type
from services.node_agent.usage import OveruseTracker, pod_uid_from_cgroup
from shared.events.catalogue import UsageSample
from shared.settings import MemoryUnit

GIB = MemoryUnit.GIB


def test_parse_fake_gpus() -> None:
    gpus = parse_fake_gpus("2x16GiB:Tesla-T4,1x80GiB:A100", "n1")
    assert [(g.index, g.model, g.memory_total_mib) for g in gpus] == [
        (0, "Tesla-T4", 16384),
        (1, "Tesla-T4", 16384),
        (2, "A100", 81920),
    ]
    assert gpus[0].uuid == fake_uuid("n1", 0) and gpus[0].uuid.startswith("GPU-")
    assert parse_fake_gpus("2x16GiB:Tesla-T4", "n1")[1].uuid == gpus[1].uuid  # stable across restarts
    assert parse_fake_gpus("2x16GiB:Tesla-T4", "n2")[0].uuid != gpus[0].uuid  # unique per node
    assert parse_fake_gpus("15360MiB", "n")[0].model == "Fake-GPU"


@pytest.mark.parametrize("bad", ["", "2x", "x16GiB", "2x16TB:T4", "0x16GiB", "2*16GiB"])
def test_parse_fake_gpus_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="fake-gpus"):
        parse_fake_gpus(bad, "n")


def test_schedulable_memory_rounds_down_to_whole_units() -> None:
    assert schedulable_mib(15109, MemoryUnit.GIB) == 14 * 1024
    assert schedulable_mib(16384, MemoryUnit.GIB) == 16384
    assert schedulable_mib(15109, MemoryUnit.MIB) == 15109


def _c(name: str, shares: list[tuple[str, int, int]], age: int, *, assigned: bool = False) -> PendingContainer:
    return PendingContainer(
        allocation_id=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        pod_uid=name,
        namespace="ns",
        pod_name=name,
        container="main",
        container_index=0,
        init=False,
        shares=tuple(Share(g, i, gib * 1024) for g, i, gib in shares),
        reserved_at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=age),
        assigned=assigned,
        pod_memory_mib=sum(s[2] for s in shares) * 1024,
    )


def test_device_ids_and_matching() -> None:
    assert gpu_of(device_id("GPU-a", 3)) == "GPU-a"
    with pytest.raises(ValueError):
        gpu_of("GPU-a")
    old, young = _c("old", [("GPU-a", 0, 4)], 0), _c("young", [("GPU-b", 1, 4)], 1)
    done = _c("done", [("GPU-a", 0, 4)], -5, assigned=True)
    avail = [device_id("GPU-a", j) for j in range(8)] + [device_id("GPU-b", j) for j in range(8)]
    pref = preferred_devices([young, old, done], set(), avail, [], 4, GIB)
    assert {gpu_of(d) for d in pref} == {"GPU-a"} and len(pref) == 4
    assert {gpu_of(d) for d in preferred_devices([young, old], {old.key}, avail, [], 4, GIB)} == {"GPU-b"}
    assert match_container([old, young], set(), [device_id("GPU-b", j) for j in range(4)], GIB) is young
    with pytest.raises(AssignmentError, match="Refusing rather than guessing"):
        match_container([old, young], set(), [device_id("GPU-b", j) for j in range(3)], GIB)
    with pytest.raises(AssignmentError):
        match_container([old], {old.key}, [device_id("GPU-a", j) for j in range(4)], GIB)


def test_container_env() -> None:
    c = _c("p", [("GPU-a", 0, 4), ("GPU-b", 1, 4)], 0)
    env = container_env(c, {"GPU-a": 16384, "GPU-b": 16384}, {"GPU-a": 16384, "GPU-b": 16384}, GIB, mps=True)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["ALIYUN_COM_GPU_MEM_POD"] == "8" and env["ALIYUN_COM_GPU_MEM_DEV"] == "16"
    assert env["GPUSHARE_GPU_MEMORY_FRACTION"] == "0.2500"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M,1=4096M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in container_env(c, {}, {}, GIB, mps=False)


def test_labels() -> None:
    assert short_type("Tesla-T4") == "t4"
    assert short_type("NVIDIA A100-SXM4-80GB") == "a100"
    assert short_type("NVIDIA GeForce RTX 4090") == "rtx4090"
    gpus = parse_fake_gpus("2x16GiB:Tesla-T4", "n")
    labels = node_labels(
        gpus, "550.1", "12.4", type_label_key="gpu-type", schedulable_mib={g.uuid: 16384 for g in gpus}
    )
    assert labels["gpu-type"] == "t4" and labels["gpushare.io/gpu-count"] == "2"
    assert labels["gpushare.io/gpu-memory-mib"] == "16384" and labels["gpushare.io/gpu-model"] == "Tesla-T4"
    mixed = parse_fake_gpus("1x16GiB:Tesla-T4,1x80GiB:A100", "n")
    labels = node_labels(mixed, "", "", type_label_key="gpu-type", schedulable_mib={})
    assert labels["gpu-type"] == "mixed" and labels["gpushare.io/model.a100"] == "1"


def test_pod_uid_from_cgroup() -> None:
    uid = "0f3e1c2a-1b2c-4d5e-8f90-123456789abc"
    cgroupfs = f"12:memory:/kubepods/burstable/pod{uid}/abcdef\n"
    systemd = f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice/cri"
    assert pod_uid_from_cgroup(cgroupfs) == uid
    assert pod_uid_from_cgroup(systemd) == uid
    assert pod_uid_from_cgroup("0::/user.slice/session-1.scope") == ""


def test_overuse_tracker_reports_once_after_grace() -> None:
    t = OveruseTracker(grace_s=10)
    s = UsageSample(gpu_uuid="GPU-a", pod_uid="p", used_memory_mib=5000)
    alloc = {("p", "GPU-a"): 4096}
    assert t.update([s], alloc, now=0) == []
    assert t.update([s], alloc, now=5) == []
    assert [x[1] for x in t.update([s], alloc, now=11)] == [4096]
    assert t.update([s], alloc, now=12) == []  # once per episode
    ok = UsageSample(gpu_uuid="GPU-a", pod_uid="p", used_memory_mib=100)
    assert t.update([ok], alloc, now=13) == [] and t.over() == set()


def test_use_of_a_gpu_where_the_pod_holds_nothing_is_reported_not_skipped() -> None:
    t = OveruseTracker(grace_s=10)
    alloc = {("p", "GPU-a"): 4096}
    elsewhere = UsageSample(gpu_uuid="GPU-b", pod_uid="p", used_memory_mib=300)  # its share is on GPU-a
    stranger = UsageSample(gpu_uuid="GPU-a", pod_uid="q", used_memory_mib=1)  # a pod with no share at all
    host = UsageSample(gpu_uuid="GPU-a", pod_uid="", used_memory_mib=50)  # outside pods: not judged
    assert t.update([elsewhere, stranger, host], alloc, now=0) == []
    found = t.update([elsewhere, stranger, host], alloc, now=10)
    assert sorted((s.pod_uid, s.gpu_uuid, limit) for s, limit in found) == [("p", "GPU-b", None), ("q", "GPU-a", None)]
    assert t.over() == {("p", "GPU-b"), ("q", "GPU-a")}
    assert t.update([], alloc, now=11) == [] and t.over() == set()  # the episode ends with the use


def test_missing_grpc_modules_are_named_never_compiled_at_run_time(tmp_path: Path) -> None:
    """A checkout that was never built: `load()` says how to build the modules and writes nothing."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "shared", tmp_path / "shared", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    before = sorted(p.name for p in (tmp_path / "shared" / "kubelet_api").iterdir())
    script = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
        "from shared.kubelet_api import load, StubsMissing\n"
        "try:\n    load('deviceplugin')\nexcept StubsMissing as exc:\n    print(exc)\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "are not built" in out.stdout and "python -m shared.kubelet_api" in out.stdout, out.stdout
    assert sorted(p.name for p in (tmp_path / "shared" / "kubelet_api").iterdir()) == before


def test_proto_compilation_is_idempotent_and_uses_kubelet_packages() -> None:
    from shared.kubelet_api import load
    from shared.kubelet_api.build import compile_protos

    compile_protos()
    assert compile_protos() == []  # up to date: nothing to do
    dp, dp_grpc = load("deviceplugin")
    pr, _ = load("podresources")
    assert dp.DESCRIPTOR.package == "v1beta1" and pr.DESCRIPTOR.package == "v1"
    assert dp.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    assert pr.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"
    fields = {f.name: f.number for f in dp.ContainerPreferredAllocationRequest.DESCRIPTOR.fields}
    assert fields == {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert hasattr(dp_grpc, "DevicePluginServicer")
