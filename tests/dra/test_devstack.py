"""`gpushare up --dra` (`make run ARGS=--dra`): the flags and the demo on DRA nodes (no control plane)."""

from __future__ import annotations

import pytest

from devstack.stack.cli import config_from
from devstack.stack.demo import demo_deployments
from devstack.stack.stack import Stack, StackConfig
from services.cli import build_parser
from shared.annotations import RESOURCE_MEM
from shared.dra import DEVICE_CLASS
from shared.dra.admission import rewrite_pod
from shared.settings import MemoryUnit, Settings
from tests.dra.patching import apply_patch


def _up(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["up", "--no-usage", *argv])
    return config_from(args, Settings())


def test_dra_makes_every_node_a_dra_node_and_dra_nodes_the_last_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _up("--dra", "--nodes", "3", "--data-dir", str(tmp_path))
    assert config.dra_nodes == 3
    mixed = _up("--dra-nodes", "1", "--nodes", "3", "--data-dir", str(tmp_path))
    stack = Stack(StackConfig(data_dir=tmp_path, nodes=3, dra_nodes=mixed.dra_nodes, node_prefix="n"))
    assert stack.dra_node_names == [stack.node_names[-1]]
    assert Stack(StackConfig(data_dir=tmp_path, nodes=2)).dra_node_names == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--dra", "--simulate"), "needs the local control plane"),
        (("--dra-nodes", "5", "--nodes", "2"), "between 0 and --nodes"),
    ],
)
def test_impossible_dra_flags_are_refused_with_the_reason(tmp_path, argv: tuple[str, ...], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit, match=message):
        _up(*argv, "--data-dir", str(tmp_path))


def test_dra_nodes_do_not_run_in_the_fleet_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="fleet"):
        Stack(StackConfig(data_dir=tmp_path, nodes=2, dra_nodes=1, fleet=True))


def test_the_dra_demo_is_the_unchanged_demo_and_admission_asks_the_same_shares() -> None:
    """`gpushare up --dra` submits the README's Deployments as they are (in a namespace labelled
    gpushare.io/allocator=dra): gpushare admission turns each pod's gpu-mem limit into a claim of that memory."""
    for dep in demo_deployments():
        template = dep["spec"]["template"]
        (container,) = template["spec"]["containers"]
        gib = container["resources"]["limits"][RESOURCE_MEM]
        rewrite = rewrite_pod(template, "gpushare-demo", MemoryUnit.GIB)
        assert rewrite is not None
        (request,) = rewrite.template["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == DEVICE_CLASS
        assert request["exactly"]["capacity"] == {"requests": {"memory": f"{gib}Gi"}}
        pod = apply_patch(template, rewrite.patch)
        assert pod["spec"]["containers"][0]["resources"] == {
            "limits": {},
            "claims": [{"name": "gpushare", "request": container["name"]}],
        }
