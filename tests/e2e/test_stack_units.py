"""The pure parts of `gpushare up`: GPU specs, command lines, the simulator's wire bodies."""

from __future__ import annotations

import pytest

from devstack.stack import spec
from devstack.stack.demo import demo_deployments, demo_pod_count
from devstack.stack.simulator import bind_args, filter_args, filter_result, pick_host, pods_of_deployments
from shared.placement.demand import parse_pod


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
