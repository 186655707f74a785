"""The chart's single-machine install (`singleMachine.enabled`, charts/gpushare/values-single-machine.yaml): a cluster
whose nodes run on one machine with no cluster network. Rendered here: every pod on the host network of the one
node, every server on the single-machine address at its own port, every client pointed there, one of each
server; what cannot work that way is refused with the value to change. tests/realchart/ installs it for real.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart import CHART, RELEASE, helm_binary, helm_errors, run_helm, template, values_file
from tests.deploy.tools import NAMESPACE, find, load_all, pod_spec

SINGLE = yaml.safe_load((CHART / "values-single-machine.yaml").read_text())
PORTS = {
    "postgres": 25432,
    "nats": 24222,
    "natsMonitor": 28222,
    "extender": 22345,
    "binder": 28081,
    "accounting": 28080,
    "nodeAgent": 29119,
}
NODE = {"kubernetes.io/hostname": "node-a"}
VALUES: dict[str, Any] = {
    **SINGLE,
    "singleMachine": {
        **SINGLE["singleMachine"],
        "nodeSelector": NODE,
        "ports": PORTS,
        "apiServer": {"host": "127.0.0.1", "port": 38093},
    },
    "nodeAgent": {"kubeletRootDir": "/tmp/node-a/kubelet", "extraArgs": ["--fake-gpus", "2x16GiB:Tesla-T4"]},
}
KUBE_CLIENTS = {"gpushare-extender", "gpushare-binder", "gpushare-accounting", "gpushare-node-agent"}


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


@pytest.fixture(scope="module")
def objects(helm: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return template(helm, VALUES, (), tmp_path_factory.mktemp("single"))


def _tests(helm: str, tmp_path: Path) -> list[dict[str, Any]]:
    values = values_file(VALUES, tmp_path)
    rendered = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values)).stdout
    return [o for o in load_all(rendered) if o["kind"] == "Pod"]


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: spec for o in objects if (spec := pod_spec(o)) is not None}


def test_lint_passes(helm: str, tmp_path: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values_file(VALUES, tmp_path)), check=False)
    assert proc.returncode == 0, f"{proc.stdout}\n{helm_errors(proc.stderr)}"


def test_every_pod_is_on_the_host_network_of_the_one_node(
    helm: str, objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    pods = _pods(objects) | {p["metadata"]["name"]: p["spec"] for p in _tests(helm, tmp_path)}
    assert set(pods) >= {
        "gpushare-extender",
        "gpushare-binder",
        "gpushare-accounting",
        "gpushare-node-agent",
        "postgres",
        "nats",
        "gpushare-migrate-0-2-0",
        "gpushare-test-services",
        "gpushare-test-inspect",
    }
    for name, spec in pods.items():
        assert spec.get("hostNetwork") is True, name
        assert spec["nodeSelector"].items() >= NODE.items(), name
    assert find(objects, "DaemonSet", "gpushare-node-agent")["spec"]["template"]["spec"]["nodeSelector"] == {
        "gpushare": "true",
        **NODE,
    }


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_server_listens_on_the_address_at_its_own_port(objects: list[dict[str, Any]]) -> None:
    pods = _pods(objects)
    ports: dict[str, int] = {}
    for name, spec in pods.items():
        for container in spec["containers"]:
            for port in container.get("ports", []):
                assert port["containerPort"] not in ports.values(), f"{name}: {port} taken twice"
                ports[f"{name}/{port['name']}"] = port["containerPort"]
    assert ports == {
        "gpushare-extender/http": PORTS["extender"],
        "gpushare-binder/http": PORTS["binder"],
        "gpushare-accounting/http": PORTS["accounting"],
        "gpushare-node-agent/metrics": PORTS["nodeAgent"],
        "postgres/postgres": PORTS["postgres"],
        "nats/client": PORTS["nats"],
        "nats/monitor": PORTS["natsMonitor"],
    }
    for name, flag in (
        ("gpushare-extender", "--port"),
        ("gpushare-binder", "--port"),
        ("gpushare-accounting", "--port"),
        ("gpushare-node-agent", "--metrics-port"),
    ):
        args = pods[name]["containers"][0]["args"]
        assert _arg(args, "--host") == "127.0.0.1", name
        assert int(_arg(args, flag)) == ports[next(k for k in ports if k.startswith(name + "/"))], name
    postgres = pods["postgres"]["containers"][0]
    assert postgres["args"] == ["-c", "listen_addresses=127.0.0.1"]
    assert {"name": "PGPORT", "value": str(PORTS["postgres"])} in postgres["env"]
    assert postgres["readinessProbe"]["exec"]["command"][-1] == "127.0.0.1"
    conf = find(objects, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert f"listen: 127.0.0.1:{PORTS['nats']}" in conf.splitlines()
    assert f"http: 127.0.0.1:{PORTS['natsMonitor']}" in conf.splitlines()
    assert not re.search(r"(?m)^(port|http_port):|^cluster", conf), conf
    assert "jetstream {" in conf and "include ./nats-auth.conf" in conf


def test_every_client_finds_its_server_at_the_address(helm: str, objects: list[dict[str, Any]], tmp_path: Path) -> None:
    config = find(objects, "ConfigMap", "gpushare-config")["data"]
    assert config["GPUSHARE_NATS_URL"] == f"nats://127.0.0.1:{PORTS['nats']}"
    assert config["GPUSHARE_DATABASE_SERVER"] == f"127.0.0.1:{PORTS['postgres']}/gpushare"
    assert config["GPUSHARE_ACCOUNTING_URL"] == f"http://127.0.0.1:{PORTS['accounting']}"
    assert config["GPUSHARE_STREAM_REPLICAS"] == "1"
    for name, spec in _pods(objects).items():
        env = {e["name"]: e.get("value") for c in spec["containers"] for e in c.get("env", [])}
        if name in KUBE_CLIENTS:
            assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "38093"), name
        else:
            assert "KUBERNETES_SERVICE_HOST" not in env, name
    tests = {p["metadata"]["name"]: p["spec"]["containers"][0] for p in _tests(helm, tmp_path)}
    checks = dict(json.loads(tests["gpushare-test-services"]["command"][-1]))
    assert checks == {
        "extender": f"http://127.0.0.1:{PORTS['extender']}/readyz",
        "binder": f"http://127.0.0.1:{PORTS['binder']}/readyz",
        "accounting": f"http://127.0.0.1:{PORTS['accounting']}/readyz",
        "nats": f"http://127.0.0.1:{PORTS['natsMonitor']}/healthz?js-enabled-only=true",
    }
    assert tests["gpushare-test-inspect"]["args"] == [
        "inspect",
        "--accounting-url",
        f"http://127.0.0.1:{PORTS['accounting']}",
    ]
    notes = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "-f", str(values_file(VALUES, tmp_path)))
    assert f"urlPrefix: http://127.0.0.1:{PORTS['extender']}/gpushare-scheduler" in notes.stdout


def test_no_service_fronts_an_address_on_loopback(objects: list[dict[str, Any]]) -> None:
    """No kube-proxy routes to a Service here, and the endpoint controllers refuse a loopback address ("may not
    be in the loopback range", seen on v1.37.2 with every Service of the chart): none is rendered."""
    assert not [o["metadata"]["name"] for o in objects if o["kind"] == "Service"]


def test_one_of_each_server_replaced_not_rolled(objects: list[dict[str, Any]]) -> None:
    assert find(objects, "StatefulSet", "nats")["spec"]["replicas"] == 1
    assert find(objects, "StatefulSet", "postgres")["spec"]["replicas"] == 1
    for name in ("gpushare-extender", "gpushare-binder", "gpushare-accounting"):
        deployment = find(objects, "Deployment", name)
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}, name
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] != "nats"]


def test_the_node_agent_finds_kubelet_under_its_root_dir_and_takes_extra_flags(objects: list[dict[str, Any]]) -> None:
    spec = find(objects, "DaemonSet", "gpushare-node-agent")["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert _arg(args, "--device-plugin-dir") == "/tmp/node-a/kubelet/device-plugins"
    assert _arg(args, "--pod-resources-socket") == "/tmp/node-a/kubelet/pod-resources/kubelet.sock"
    assert args[-2:] == ["--fake-gpus", "2x16GiB:Tesla-T4"]
    assert {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v} == {
        "/tmp/node-a/kubelet/device-plugins",
        "/tmp/node-a/kubelet/pod-resources",
    }


def test_the_default_install_is_untouched(helm: str, tmp_path: Path) -> None:
    """Off by default: nothing of the single-machine install is rendered (test_chart.py compares the default with
    k8s/base field by field)."""
    rendered = template(helm, {}, (), tmp_path)
    for obj in rendered:
        spec = pod_spec(obj) or {}
        assert "hostNetwork" not in spec, obj["metadata"]["name"]
    assert find(rendered, "StatefulSet", "nats")["spec"]["replicas"] == 3


REFUSED = [
    ({"extender": {"replicas": 2}}, "set extender.replicas=1"),
    ({"binder": {"replicas": 2}}, "set binder.replicas=1"),
    ({"accounting": {"replicas": 3}}, "set accounting.replicas=1"),
    ({"config": {"streamReplicas": 3}}, "set config.streamReplicas=1"),
    ({"scheduler": {"mode": "second-scheduler"}}, "use scheduler.mode=default"),
    ({"dra": {"enabled": True}}, "leave dra.enabled=false"),
    ({"postgresql": {"mode": "cloudnativepg"}}, "use postgresql.mode=statefulset"),
    ({"extender": {"tls": {"enabled": True}}}, "leave extender.tls.enabled=false"),
]


@pytest.mark.parametrize(("change", "said"), REFUSED, ids=[s for _, s in REFUSED])
def test_what_cannot_share_one_machine_is_refused_with_the_value_to_change(
    helm: str, change: dict[str, Any], said: str, tmp_path: Path
) -> None:
    values = json.loads(json.dumps(VALUES))
    for top, sub in change.items():
        values[top] = {**values.get(top, {}), **sub}
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file(values, tmp_path))]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode != 0, f"accepted {change}"
    assert said in helm_errors(proc.stderr), helm_errors(proc.stderr)


def test_a_wrong_single_machine_value_is_named(helm: str, tmp_path: Path) -> None:
    for values, said in (
        ({"singleMachine": {"address": "localhost"}}, "/singleMachine/address"),
        ({"singleMachine": {"ports": {"nats": 70000}}}, "/singleMachine/ports/nats"),
        ({"nodeAgent": {"kubeletRootDir": "var/lib/kubelet"}}, "/nodeAgent/kubeletRootDir"),
    ):
        args = ["template", RELEASE, str(CHART), "-f", str(values_file(values, tmp_path))]
        proc = run_helm(helm, *args, check=False)
        assert proc.returncode != 0 and said in helm_errors(proc.stderr), helm_errors(proc.stderr)
