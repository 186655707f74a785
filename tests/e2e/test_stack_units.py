"""The pure parts of `gpushare up`: GPU specs, command lines, the simulator's wire bodies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devstack.stack import spec
from devstack.stack.demo import demo_deployments, demo_pod_count
from devstack.stack.simulator import bind_args, filter_args, filter_result, pick_host, pods_of_deployments
from shared.placement.demand import parse_pod
from shared.settings import MemoryUnit


def test_parse_gpus_accepts_counts_units_and_models() -> None:
    assert spec.parse_gpus("1x16GiB:Tesla-T4") == [spec.GpuModelSpec(1, 16 * 1024, "Tesla-T4")]
    assert spec.parse_gpus("2x24GiB:A10,8192MiB:T4") == [
        spec.GpuModelSpec(2, 24 * 1024, "A10"),
        spec.GpuModelSpec(1, 8192, "T4"),
    ]
    assert spec.node_gpus("2x16GiB:Tesla-T4") == [(16, "Tesla-T4"), (16, "Tesla-T4")]


@pytest.mark.parametrize("bad", ["", "x16", "0x16GiB:T4", "16TB:T4", "1x16GiB:bad model"])
def test_parse_gpus_rejects_nonsense(bad: str) -> None:
    with pytest.raises(ValueError, match="bad GPU spec"):
        spec.parse_gpus(bad)


def test_service_commands_use_the_cli_contract() -> None:
    common = spec.CommonFlags(
        database_url="postgresql://x/y", nats_url="nats://n:1", stream_name="S", subject_prefix="p"
    )
    ext = spec.extender_command(common, 1234, 7)
    assert ext.argv[1:4] == ["-m", "services.cli", "extender"]
    assert ext.argv[ext.argv.index("--prefix") + 1] == "/gpushare-scheduler"
    assert ext.argv[ext.argv.index("--bind-timeout") + 1] == "7"
    for flag, value in (("--database-url", "postgresql://x/y"), ("--stream-name", "S"), ("--subject-prefix", "p")):
        assert ext.argv[ext.argv.index(flag) + 1] == value
    agent = spec.node_agent_command(
        common,
        node="n1",
        gpus="1x16GiB:T4",
        device_plugin_dir="/d",
        pod_resources_socket="/s",
        metrics_port=9,
        kubeconfig="/k",
    )
    assert agent.name == "node-agent-n1" and agent.ready_url == "http://127.0.0.1:9/healthz"
    # every service of a local stack listens on loopback only, the node agents too (they listened on 0.0.0.0)
    for command in (ext, agent):
        assert command.argv[command.argv.index("--host") + 1] == "127.0.0.1", command.argv
    assert agent.argv[agent.argv.index("--fake-gpus") + 1] == "1x16GiB:T4"


def test_simulator_sends_what_kube_scheduler_sends() -> None:
    pods = pods_of_deployments(demo_deployments(), "demo")
    assert len(pods) == demo_pod_count(demo_deployments()) == 6
    body = filter_args(pods[0], ["a", "b"])
    assert set(body) == {"Pod", "Nodes", "NodeNames"} and body["Nodes"] is None and body["NodeNames"] == ["a", "b"]
    assert bind_args(pods[0], "b") == {
        "PodName": pods[0]["metadata"]["name"],
        "PodNamespace": "demo",
        "PodUID": pods[0]["metadata"]["uid"],
        "Node": "b",
    }
    # the placement core reads the simulated pods exactly as it reads real ones
    assert {parse_pod(p).memory_mib for p in pods} == {4 * 1024, 2 * 1024}
    assert filter_result({"NodeNames": ["a"], "FailedNodes": {"b": "full"}, "Error": ""}) == (["a"], {"b": "full"}, "")
    assert (
        pick_host(["a", "b", "c"], [{"Host": "a", "Score": 3}, {"Host": "b", "Score": 7}, {"Host": "c", "Score": 7}])
        == "b"
    )
    assert pick_host(["a", "b"], []) == "a"


def test_node_agents_get_the_simulated_usage_flags() -> None:
    common = spec.CommonFlags(database_url="", nats_url="nats://n:1")
    usage = spec.AgentUsage("@/data/usage.rules", interval_s=2, overuse_grace_s=20)
    agent = spec.node_agent_command(
        common, node="n1", gpus="1x16GiB:T4", device_plugin_dir="/d", pod_resources_socket="/s", metrics_port=9,
        kubeconfig=None, usage=usage,
    )  # fmt: skip
    flags = dict(zip(agent.argv, agent.argv[1:], strict=False))
    assert flags["--simulate-usage"] == "@/data/usage.rules"
    assert flags["--usage-interval"] == "2" and flags["--overuse-grace"] == "20"
    plain = spec.node_agent_command(
        common, node="n1", gpus="1x16GiB:T4", device_plugin_dir="/d", pod_resources_socket="/s", metrics_port=9,
        kubeconfig=None,
    )  # fmt: skip
    assert "--simulate-usage" not in plain.argv  # no rules: no simulated usage
    assert agent.metrics_target == "127.0.0.1:9"
    assert spec.extender_command(common, 1234, 7).metrics_target == "127.0.0.1:1234"


def test_gpushare_up_usage_flags(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from devstack.stack.cli import OVERUSE_GRACE_S, agent_usage
    from devstack.stack.demo import DEMO_USAGE_RULES

    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"usage": None, "simulate_usage": True, "usage_interval": 5.0, **kw})

    monkeypatch.setattr("services.node_agent.discovery.nvidia_gpus_present", lambda: "")
    usage, note = agent_usage(args(), tmp_path)
    assert usage.simulate == f"@{tmp_path / 'usage.rules'}" and usage.overuse_grace_s == OVERUSE_GRACE_S
    assert (tmp_path / "usage.rules").read_text() == DEMO_USAGE_RULES and "rules in" in note
    (tmp_path / "usage.rules").write_text("mine=idle\n")
    agent_usage(args(), tmp_path)
    assert (tmp_path / "usage.rules").read_text() == "mine=idle\n"  # an edited file is kept
    assert agent_usage(args(usage="*=steady:0.3"), tmp_path)[0].simulate == "*=steady:0.3"
    with pytest.raises(SystemExit, match="unknown usage shape"):
        agent_usage(args(usage="*=lots"), tmp_path)
    assert agent_usage(args(simulate_usage=False), tmp_path) == (
        spec.AgentUsage(None, 5.0, OVERUSE_GRACE_S),
        "no simulated usage (--no-usage)",
    )
    monkeypatch.setattr("services.node_agent.discovery.nvidia_gpus_present", lambda: "/dev/nvidia0 exists")
    usage, note = agent_usage(args(), tmp_path)
    assert usage.simulate is None and "this machine has NVIDIA GPUs (/dev/nvidia0 exists)" in note


def test_rightsizing_lines_say_what_repacking_frees() -> None:
    from devstack.stack.demo_run import rightsizing_lines

    items = [
        {"owner_name": "infer-1", "pods_sampled": 4, "summary": "s1", "allocated_mib": 2048, "recommended_mib": 1024},
        {"owner_name": "train-2", "pods_sampled": 2, "summary": "s2", "allocated_mib": 4096, "recommended_mib": 5120},
    ]
    lines = rightsizing_lines(items)
    assert lines[:2] == ["  infer-1  4 pod(s): s1", "  train-2  2 pod(s): s2"]
    assert lines[2] == (
        "  repacked at the recommended sizes these pods need 14 GiB instead of 16 GiB: frees 2 GiB, +14% pods per GPU"
    )
    assert "no usage samples yet" in rightsizing_lines([])[0]


def test_kubelet_stand_in_reports_started_pods_running() -> None:
    from datetime import UTC, datetime

    from devstack.stack.kubelets import running_status

    pod = {"spec": {"containers": [{"name": "a", "image": "img"}, {"name": "b"}]}}
    status = running_status(pod, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))["status"]
    assert status["phase"] == "Running" and status["startTime"] == "2026-01-02T03:04:05Z"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    assert [(c["name"], c["ready"], "running" in c["state"]) for c in status["containerStatuses"]] == [
        ("a", True, True),
        ("b", True, True),
    ]


def test_the_fleet_gets_simulated_usage_only_when_there_are_rules() -> None:
    common = spec.CommonFlags(database_url="", nats_url="nats://n:1")
    kw = {"nodes": ["a", "b"], "gpus": "1x16GiB:T4", "socket_dir": "/s", "kubeconfig": "/k", "port": 1, "addresses": {}}
    plain = spec.fleet_command(common, **kw, usage=spec.AgentUsage())
    assert "--simulate-usage" not in plain.argv and "--usage-interval" not in plain.argv  # keeps its own interval
    simulated = spec.fleet_command(common, **kw, usage=spec.AgentUsage("*=steady:0.5", 2, 10))
    flags = dict(zip(simulated.argv, simulated.argv[1:], strict=False))
    assert flags["--simulate-usage"] == "*=steady:0.5" and flags["--usage-interval"] == "2"
    assert flags["--overuse-grace"] == "10"


def test_up_help_names_the_release_the_local_control_plane_runs() -> None:
    """`gpushare up --help` said "Kubernetes 1.20" after the default moved to the current release."""
    import argparse

    from devstack.cluster.releases import CURRENT_VERSION, VERSION_ENV
    from services.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    description = sub.choices["up"].description or ""
    assert CURRENT_VERSION in description and VERSION_ENV in description
    assert "Kubernetes 1.20" not in description


class _ScriptedSocket:
    """A socket whose port-0 bind gets the next port of a script, as the kernel may hand out a port it just gave."""

    script: list[int] = []

    def __init__(self, *args: object) -> None:
        self.port = 0

    def __enter__(self) -> _ScriptedSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = address[1] or _ScriptedSocket.script.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        return None


def test_a_stack_never_hands_two_services_the_same_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CI once read `gpushare up` list the extender and accounting on one port: both picks bound port 0 and let
    it go, the kernel gave the same port twice, accounting could not listen, and its readiness probe got its
    answer from the extender. Ports handed out by this process are now never handed out again."""
    import devstack.embedded as embedded
    from devstack.embedded import port_or_free

    monkeypatch.setattr(embedded.socket, "socket", _ScriptedSocket)
    monkeypatch.setattr(embedded, "PORT_CLAIMS", tmp_path)
    script = [40423, 40423, 40425, 40425, 40427]  # the same candidate may come twice
    monkeypatch.setattr(embedded, "_candidate", lambda: script.pop(0))
    first, second = embedded.free_port(), port_or_free(0)
    assert first == 40423 and second == 40425
    assert port_or_free(40425) == 40427  # a preferred port this process already gave out is not given again


def test_ports_for_servers_started_one_by_one_are_never_the_same(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The test tiers start binders, extenders and control planes with a port each, one call at a time
    (`free_ports(1)`): each call used to bind port 0 and let it go, so two replicas could get one port and the second
    could not listen. They share the stack's record of the ports handed out."""
    import devstack.embedded as embedded
    from devstack.cluster.controlplane import free_ports

    monkeypatch.setattr(embedded, "_HANDED_OUT", set())
    monkeypatch.setattr(embedded.socket, "socket", _ScriptedSocket)
    monkeypatch.setattr(embedded, "PORT_CLAIMS", tmp_path)
    script = [41001, 41001, 41003, 41005, 41003, 41007]
    monkeypatch.setattr(embedded, "_candidate", lambda: script.pop(0))
    assert free_ports(1) == [41001] and free_ports(1) == [41003]
    assert free_ports(2) == [41005, 41007]


def test_ports_are_handed_out_outside_the_kernels_range_for_outgoing_connections(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """CI: a node agent could not listen on the port it was handed ("address already in use"). Ports came from a
    port-0 bind, inside the kernel's ephemeral range, where any process's outgoing connection (three test workers
    make thousands) may take the port before the server listens. They now come from outside that range."""
    import devstack.embedded as embedded

    monkeypatch.setattr(embedded, "PORT_CLAIMS", tmp_path)
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [embedded.free_port() for _ in range(50)]
    inside = [p for p in ports if low <= p <= high]
    assert not inside, f"{len(inside)} of 50 ports in the ephemeral range {low}-{high}: {inside[:5]}"
    assert all(p >= embedded.FIRST_PORT for p in ports) and len(set(ports)) == 50


def test_a_port_another_living_process_claimed_is_not_handed_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The parallel test workers are processes of their own: a port one of them handed out is not handed out by
    another while the first lives; the claim of a process that is gone is taken over."""
    import subprocess

    import devstack.embedded as embedded

    monkeypatch.setattr(embedded, "PORT_CLAIMS", tmp_path)
    monkeypatch.setattr(embedded.socket, "socket", _ScriptedSocket)
    living = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        (tmp_path / "42001").write_text(str(living.pid))
        (tmp_path / "42003").write_text(str(gone.pid))
        script = [42001, 42003]
        monkeypatch.setattr(embedded, "_candidate", lambda: script.pop(0))
        assert embedded.free_port() == 42003
        assert (tmp_path / "42003").read_text() == str(os.getpid())
        assert (tmp_path / "42001").read_text() == str(living.pid)
    finally:
        living.kill()
        living.wait()


def test_gpushare_up_keeps_json_logs_in_its_log_file_and_plain_lines_on_the_terminal(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import logging

    from devstack.stack.cli import configure_up_logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        path = configure_up_logging(tmp_path / "logs", "INFO", "json")
        log = logging.getLogger("devstack.stack.processes")
        log.info("started %s", "extender", extra={"service": "extender", "pid": 42})
        log.warning("binder exited; see %s", "binder.log", extra={"service": "binder"})
        for handler in root.handlers:
            handler.flush()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert err == "WARNING: binder exited; see binder.log\n"  # a person's line, no JSON, no INFO chatter
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["level"], r["msg"], r.get("service")) for r in lines] == [
        ("info", "started extender", "extender"),
        ("warning", "binder exited; see binder.log", "binder"),
    ]


def test_the_demo_in_mib_asks_for_the_same_memory_and_adds_the_guides_half_gigabyte_pods() -> None:
    from devstack.stack.demo import DemoError

    def limits(deployments: list[dict]) -> dict[str, tuple[int, str]]:
        return {
            d["metadata"]["name"]: (
                d["spec"]["replicas"],
                d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-mem"],
            )
            for d in deployments
        }

    assert limits(demo_deployments()) == {"bert-training": (2, "4"), "resnet-inference": (4, "2")}
    mib = demo_deployments(unit_mib=1, dev_pods=3)
    assert limits(mib) == {"bert-training": (2, "4096"), "resnet-inference": (4, "2048"), "dev-notebook": (3, "512")}
    # the placement core reads 512 units of a MiB cluster as 512 MiB
    pods = pods_of_deployments(mib, "demo")
    assert sorted({parse_pod(p, MemoryUnit.MIB).memory_mib for p in pods}) == [512, 2048, 4096]
    with pytest.raises(DemoError, match="add --memory-unit MiB"):
        demo_deployments(dev_pods=1)  # half a GiB is no whole number of GiB


def test_replicated_services_get_their_own_names_ports_and_lease_identities() -> None:
    common = spec.CommonFlags(database_url="postgresql://x/y", nats_url="nats://n:1")
    assert spec.replica_names("binder", 1) == ["binder"]
    assert spec.replica_names("binder", 2) == ["binder-1", "binder-2"]
    binder = spec.binder_command(common, 4321, "/k", name="binder-2")
    assert binder.name == "binder-2" and binder.port == 4321
    assert binder.argv[binder.argv.index("--lease-identity") + 1] == "binder-2"
    assert binder.argv[binder.argv.index("--lease-namespace") + 1] == "default"
    assert spec.extender_command(common, 1234, 7, name="extender-1").name == "extender-1"


def test_kube_schedulers_elect_a_leader_through_the_usual_lease_only_when_replicated(tmp_path) -> None:
    from devstack.cluster.controlplane import scheduler_config

    single = scheduler_config(tmp_path / "k")
    assert single["leaderElection"] == {"leaderElect": False}
    replicated = scheduler_config(tmp_path / "k", leader_elect=True)
    assert replicated["leaderElection"] == {
        "leaderElect": True,
        "resourceLock": "leases",
        "resourceName": "kube-scheduler",
        "resourceNamespace": "kube-system",
    }
