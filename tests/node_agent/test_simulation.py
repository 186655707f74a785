"""Simulated usage (`--simulate-usage`): profiles, the simulated processes, their cgroups, and the agent's real
usage path (samples on the bus, metrics, over-use) driven by them for pods kubelet admitted."""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.node_agent import cli
from services.node_agent.assignment import PendingContainer, Share
from services.node_agent.discovery import FakeBackend, NoGpuBackend, UsageRules, nvidia_gpus_present
from services.node_agent.simulation import (
    PID_BASE,
    ProfileError,
    UsageSimulation,
    parse_rules,
    parse_shape,
    shape_for,
    utilization,
)
from services.node_agent.usage import pod_uid_from_cgroup
from shared.events.catalogue import UsageEvent, decode_event
from tests.node_agent.conftest import Harness
from tests.waiting import eventually


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def container(pod: str, name: str = "main", *, gib: int = 2, assigned: bool = True, init: bool = False):
    uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, pod))
    return PendingContainer(
        allocation_id=uuid.uuid5(uuid.NAMESPACE_URL, pod),
        pod_uid=uid,
        namespace="ns",
        pod_name=pod,
        container=name,
        container_index=0,
        init=init,
        shares=(Share("GPU-a", 0, gib * 1024),),
        reserved_at=datetime.now(UTC),
        assigned=assigned,
    )


# -- profiles ---------------------------------------------------------------------------------------------------
def test_shapes_follow_time() -> None:
    assert parse_shape("steady:0.65").fraction(0) == 0.65
    ramp = parse_shape("ramp:0.2:0.8:60")
    assert [ramp.fraction(t) for t in (0, 30, 60, 600)] == pytest.approx([0.2, 0.5, 0.8, 0.8])
    spike = parse_shape("spike:0.5:1.3:60:10")
    assert [spike.fraction(t) for t in (0, 9, 10, 59, 60, 65)] == [1.3, 1.3, 0.5, 0.5, 1.3, 1.3]
    assert parse_shape("idle").fraction(5) is None
    assert str(parse_shape("spike:0.5:1.3:60:10")) == "spike:0.5:1.3:60:10"


def test_rules_match_namespace_and_pod_globs_first_rule_wins() -> None:
    rules = parse_rules("demo/bert-*=steady:0.9; demo=steady:0.4\n# a comment\n*=idle")
    assert str(shape_for(rules, "demo", "bert-training-abc")) == "steady:0.9"
    assert str(shape_for(rules, "demo", "resnet-1")) == "steady:0.4"
    assert str(shape_for(rules, "other", "x")) == "idle"
    assert shape_for(parse_rules("demo/*=steady:1"), "other", "x") is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("demo", "expected PATTERN=SHAPE"),
        ("demo=", "expected PATTERN=SHAPE"),
        ("demo=busy:1", "unknown usage shape 'busy:1'"),
        ("demo=steady:lots", "expected steady:F"),
        ("demo=ramp:0.1:0.9", "expected ramp:F1:F2:SECONDS"),
        ("demo=steady:9", "fractions are 0..4"),
        ("demo=spike:0.1:1.2:10:20", "FOR at most EVERY"),
        ("demo=steady:0.5,sm:2", "expected sm:F with F from 0 to 1"),
        ("demo=steady:0.5,busy", "expected sm:F with F from 0 to 1"),
    ],
)
def test_bad_rules_are_named(text: str, says: str) -> None:
    with pytest.raises(ProfileError, match=None) as caught:
        parse_rules(text)
    assert says in str(caught.value)


# -- simulated processes ------------------------------------------------------------------------------------------
def test_started_long_running_containers_get_processes_whose_cgroup_names_their_pod() -> None:
    sim = UsageSimulation(parse_rules("ns=ramp:0.5:1.0:100"))
    running = container("p1")
    not_started = container("p2", assigned=False)
    init = container("p3", init=True)
    procs = sim.step([running, not_started, init], now=10.0)
    assert [(p.pod_uid, p.used_memory_mib) for p in procs] == [(running.pod_uid, 1024)]
    (proc,) = procs
    assert proc.pid >= PID_BASE > 2**22  # above any real Linux PID
    assert pod_uid_from_cgroup(proc.cgroup) == running.pod_uid  # the agent's real mapping finds the pod
    later = sim.step([running], now=60.0)
    assert later[0].pid == proc.pid and later[0].used_memory_mib == round(2048 * 0.75)
    assert sim.step([], now=61.0) == [] and not sim.pids  # the container ended: its process too
    again = sim.step([running], now=62.0)
    assert again[0].used_memory_mib == 1024  # a new start: the ramp begins again


def test_utilization_is_the_share_in_use() -> None:
    sim = UsageSimulation(parse_rules("*=steady:0.5"))
    procs = sim.step([container("p1", gib=4), container("p2", gib=8)], now=0)
    assert utilization(procs, {"GPU-a": 16 * 1024}) == {"GPU-a": pytest.approx(37.5)}


def test_sm_utilization_of_simulated_processes_follows_the_rule_or_the_share(tmp_path: Path) -> None:
    """`,sm:F` sets the share of the GPU's SMs a pod's processes keep busy (`sm:0`: a share whose compute idles);
    without it the SM figure is the memory's part of the GPU, as the GPU's utilisation always was."""
    rules = parse_rules("ns/notebook-*=steady:0.3,sm:0; ns/train-*=steady:0.8,sm:0.45; *=steady:0.5")
    assert [str(r) for r in rules] == ["ns/notebook-*=steady:0.3,sm:0", "ns/train-*=steady:0.8,sm:0.45", "*=steady:0.5"]
    backend = FakeBackend(
        "n1",
        "1x16GiB",
        simulate="ns/notebook-*=steady:0.3,sm:0; ns/train-*=steady:0.8,sm:0.45; *=steady:0.5",
        proc_root=tmp_path,
    )
    gpu = backend.devices()[0].uuid
    pods = [container("notebook-0", gib=1), container("train-0", gib=4), container("infer-0", gib=4)]
    pods = [replace(c, shares=(Share(gpu, 0, c.shares[0].memory_mib),)) for c in pods]
    backend.attach(lambda: pods)
    try:
        backend.processes()  # one round of the simulated workloads (writes their cgroup files)
        sm = backend.process_utilization()[gpu]
        names = {c.pod_uid: c.pod_name for c in pods}
        by_pod = {names[_pod_of(pid, backend)]: pct for pid, pct in sm.items()}  # the agent's own mapping
        assert by_pod == {"notebook-0": 0.0, "train-0": 45.0, "infer-0": pytest.approx(12.5)}
        assert backend.utilization()[gpu] == pytest.approx(57.5)  # the GPU's figure is the processes' sum
    finally:
        backend.close()


def _pod_of(pid: int, backend: FakeBackend) -> str:
    assert backend.proc_root is not None
    return pod_uid_from_cgroup((backend.proc_root / str(pid) / "cgroup").read_text())


def test_rules_file_is_reread_when_it_changes_and_a_bad_one_keeps_the_rules(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "usage.rules"
    path.write_text("demo=steady:0.5\n")
    rules = UsageRules(f"@{path}")
    assert [str(r) for r in rules.current()] == ["demo/*=steady:0.5"]
    path.write_text("demo=steady:0.9   # busier now\n")
    assert [str(r) for r in rules.current()] == ["demo/*=steady:0.9"]
    with caplog.at_level(logging.ERROR):
        path.write_text("demo=steady:much\n")
        assert [str(r) for r in rules.current()] == ["demo/*=steady:0.9"]
    assert "keeping the previous rules" in caplog.text and "expected steady:F" in caplog.text
    with pytest.raises(ProfileError, match="does not exist"):
        UsageRules(f"@{tmp_path / 'missing'}")


def test_nvidia_gpus_are_noticed(tmp_path: Path) -> None:
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    (proc / "driver" / "nvidia" / "gpus").mkdir(parents=True)
    (dev / "nvidiactl").touch()  # the control node alone: no GPU
    assert nvidia_gpus_present(dev, proc) == ""
    (proc / "driver" / "nvidia" / "gpus" / "0000:17:00.0").mkdir()
    assert "lists GPUs" in nvidia_gpus_present(dev, proc)
    (dev / "nvidia0").touch()
    assert nvidia_gpus_present(dev, proc) == f"{dev / 'nvidia0'} exists"


# -- the command line: never by accident ------------------------------------------------------------------------
def _args(**kw: object) -> argparse.Namespace:
    base = {"node": "n1", "fake_gpus": None, "simulate_usage": None, "proc_root": None}
    return argparse.Namespace(**{**base, **kw})


def test_simulated_usage_needs_fake_gpus_and_a_machine_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(NoGpuBackend, match="needs --fake-gpus"):
        cli.make_backend(_args(simulate_usage="*=steady:0.5", proc_root=str(tmp_path)))
    monkeypatch.setattr("services.node_agent.discovery.nvidia_gpus_present", lambda: "/dev/nvidia0 exists")
    with pytest.raises(NoGpuBackend, match=r"refused: this machine has NVIDIA GPUs \(/dev/nvidia0 exists\)"):
        cli.make_backend(_args(fake_gpus="1x16GiB", simulate_usage="*=steady:0.5", proc_root=str(tmp_path)))
    monkeypatch.setattr("services.node_agent.discovery.nvidia_gpus_present", lambda: "")
    with pytest.raises(NoGpuBackend, match="unknown usage shape"):
        cli.make_backend(_args(fake_gpus="1x16GiB", simulate_usage="*=busy", proc_root=str(tmp_path)))
    backend = cli.make_backend(_args(fake_gpus="1x16GiB", simulate_usage="*=steady:0.5", proc_root=str(tmp_path)))
    assert isinstance(backend, FakeBackend) and backend.rules is not None
    assert cli.make_backend(_args(fake_gpus="1x16GiB")).rules is None  # without the flag: no simulation


def test_simulated_processes_never_write_into_a_real_proc(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is a real /proc"):
        cli.simulated_proc_root(_args(fake_gpus="1x16GiB", simulate_usage="*=idle", proc_root="/proc"))
    own = cli.simulated_proc_root(_args(fake_gpus="1x16GiB", simulate_usage="*=idle"))
    assert own is not None and own.is_dir() and not (own / "self").exists()
    own.rmdir()
    assert cli.simulated_proc_root(_args(fake_gpus="1x16GiB")) is None


# -- through the agent's real usage path ------------------------------------------------------------------------
CLOCK = Clock()


@pytest.mark.parametrize(
    "harness", [{"simulate": "default/busy=spike:0.5:1.5:100:10;default=steady:0.25", "clock": CLOCK}], indirect=True
)
async def test_simulated_usage_flows_through_samples_metrics_and_overuse(harness: Harness) -> None:
    busy, _ = await harness.reserve("busy", [("main", [(0, 2)])])
    calm, _ = await harness.reserve("calm", [("main", [(1, 4)])])
    waiting, _ = await harness.reserve("waiting", [("main", [(1, 2)])])  # bound, never started: no process
    await harness.kubelet.admit(busy)
    await harness.kubelet.admit(calm)

    def started() -> bool:
        return sum(c.assigned for c in harness.agent.view.containers()) == 2

    await eventually(started, what="both containers assigned in the agent's view")
    received: asyncio.Queue[UsageEvent] = asyncio.Queue()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        await received.put(decode_event(msg.data))

    sub = await harness.bus.nc.subscribe(f"{harness.bus.names.prefix}.usage.>", cb=on_msg)
    try:
        CLOCK.now += 1  # inside busy's spike: 1.5 x 2 GiB
        await harness.agent.sample_usage()
        first = await asyncio.wait_for(received.get(), 5)
        CLOCK.now += 20  # after the spike: 0.5 x 2 GiB
        await harness.agent.sample_usage()
        second = await asyncio.wait_for(received.get(), 5)
    finally:
        await sub.unsubscribe()
    uid = {p["metadata"]["name"]: p["metadata"]["uid"] for p in (busy, calm, waiting)}
    by_pod = {s.pod_uid: s for s in first.samples}
    assert set(by_pod) == {uid["busy"], uid["calm"]}
    assert by_pod[uid["busy"]].used_memory_mib == 3072 and by_pod[uid["busy"]].pod_name == "busy"
    assert by_pod[uid["busy"]].gpu_uuid == harness.gpu(0) and by_pod[uid["busy"]].container == "main"
    assert by_pod[uid["calm"]].used_memory_mib == 1024 and by_pod[uid["calm"]].gpu_uuid == harness.gpu(1)
    assert by_pod[uid["calm"]].utilization_pct == pytest.approx(100 * 1024 / 16384)
    assert by_pod[uid["calm"]].sm_utilization_pct == pytest.approx(100 * 1024 / 16384)  # its part of the GPU
    assert {s.pod_uid: s.used_memory_mib for s in second.samples}[uid["busy"]] == 1024
    # over-use: 3 GiB on a 2 GiB share past the (zero) grace, then back under
    reg = harness.agent.metrics.registry
    labels = {"node": harness.agent.config.node, "namespace": "default", "pod": "busy"}
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_overuse_episodes_total", labels) == 1
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_overuse", labels) == 0
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_used_bytes", labels) == 1024 * 1024 * 1024
    # the processes' cgroup files are where the agent reads them, and name the pods
    pid_dirs = sorted((harness.root / "proc").iterdir())
    assert len(pid_dirs) == 2 and all(int(d.name) >= PID_BASE for d in pid_dirs)
    assert {pod_uid_from_cgroup((d / "cgroup").read_text()) for d in pid_dirs} == {uid["busy"], uid["calm"]}
