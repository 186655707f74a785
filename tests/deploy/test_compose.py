"""docker-compose.yml parses, has every piece of the stack, and runs only `gpushare` commands that exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import parse_cli
from tests.deploy.tools import ROOT

GPUSHARE_IMAGE = "gpushare:dev"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_piece_is_there(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "nats", "migrate", "extender", "binder", "accounting", "node-agent", "k3s"} <= set(services)
    assert "-js" in services["nats"]["command"]
    for name, svc in services.items():
        if svc.get("image") == GPUSHARE_IMAGE:
            assert svc["build"] == ".", name
            assert svc["read_only"] is True and "/tmp" in svc["tmpfs"], name


def test_gpushare_services_run_subcommands_that_exist(compose: dict[str, Any]) -> None:
    gpushare = {n: s for n, s in compose["services"].items() if s.get("image") == GPUSHARE_IMAGE}
    assert len(gpushare) >= 6
    for name, svc in gpushare.items():
        assert "entrypoint" not in svc, f"{name}: the image's entry point is `gpushare`"
        parse_cli(svc["command"], f"docker-compose service {name}")
    agent = gpushare["node-agent"]["command"]
    assert agent[agent.index("--fake-gpus") + 1] == "2x16GiB:Tesla-T4"


def test_services_wait_for_migrations_and_bus(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("extender", "binder", "accounting", "node-agent"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["nats"]["condition"] == "service_healthy", name
        assert services[name]["network_mode"] == "service:k3s", name


def test_k3s_scheduler_is_wired_to_the_extender(compose: dict[str, Any]) -> None:
    k3s = compose["services"]["k3s"]
    (arg,) = [a for a in k3s["command"] if a.startswith("--kube-scheduler-arg=config=")]
    in_container = arg.split("=", 2)[2]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in k3s["volumes"] if m.startswith("./")}
    config = yaml.safe_load((ROOT / Path(mounts[in_container])).read_text())
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["clientConnection"]["kubeconfig"] == "/var/lib/rancher/k3s/server/cred/scheduler.kubeconfig"
    (ext,) = config["extenders"]
    port = compose["services"]["extender"]["command"][2]
    assert ext["urlPrefix"] == f"http://127.0.0.1:{port}/gpushare-scheduler"
    assert {ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"], ext["preemptVerb"]} == {
        "filter",
        "prioritize",
        "bind",
        "preempt",
    }
    assert "--node-label=gpushare=true" in k3s["command"]


def test_least_privilege_as_in_kubernetes(compose: dict[str, Any]) -> None:
    """Each service is its own PostgreSQL role and NATS user; the NATS server runs the shipped users' file; the
    development passwords are placeholders accepted only with the explicit development flag."""
    services = compose["services"]
    for name in ("extender", "binder", "accounting"):
        env = services[name]["environment"]
        assert env["GPUSHARE_DATABASE_URL"].startswith(f"postgresql://gpushare_{name}@"), name
        assert env["GPUSHARE_NATS_USER"] == f"gpushare-{name}"
        assert env["GPUSHARE_ALLOW_DEV_SECRETS"] == "true" and env["GPUSHARE_DATABASE_PASSWORD"].startswith("change-me")
    agent = services["node-agent"]["environment"]
    assert not any("DATABASE" in k for k in agent) and agent["GPUSHARE_NATS_USER"] == "gpushare-node-agent"
    nats = services["nats"]
    assert "./k8s/base/nats-auth.conf:/etc/nats/nats-auth.conf:ro" in nats["volumes"]
    assert nats["command"][:2] == ["-c", "/etc/nats/nats-auth.conf"]
    for name in ("extender", "binder", "accounting"):
        key = f"GPUSHARE_NATS_{name.upper()}_PASSWORD"
        assert nats["environment"][key] == services[name]["environment"]["GPUSHARE_NATS_PASSWORD"]
    assert nats["environment"]["GPUSHARE_NATS_NODE_AGENT_PASSWORD"] == agent["GPUSHARE_NATS_PASSWORD"]
    migrate = services["migrate"]["environment"]
    assert migrate["GPUSHARE_DATABASE_URL"].startswith("postgresql://gpushare_migrate@")
    for name in ("extender", "binder", "accounting"):
        role_password = services[name]["environment"]["GPUSHARE_DATABASE_PASSWORD"]
        assert migrate[f"GPUSHARE_DB_PASSWORD_{name.upper()}"] == role_password
    init = "./k8s/base/postgres-init.sh:/docker-entrypoint-initdb.d/init-gpushare.sh:ro"
    assert init in services["postgres"]["volumes"]
