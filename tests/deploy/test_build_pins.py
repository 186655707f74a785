"""What gets installed is decided by the repository, not by the day (issue 39).

A fresh clone once failed at `make run`: pip 26.3 (the Makefile upgraded to the newest) no longer applied
PIP_CONSTRAINT to the isolated build of `pip install -e .`, so the build requirement `grpcio-tools>=1.60` took the
newest grpcio-tools served that day (1.85.4), whose generated modules refuse the grpcio 1.85.3 of constraints.txt.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

from shared.kubelet_api import PROTOS
from shared.kubelet_api.build import ROOT, mismatches, required_runtime, runtime_mismatches

CONSTRAINTS = ROOT / "constraints.txt"
MAKEFILE = (ROOT / "Makefile").read_text()


def _pinned() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_generated_module_runs_with_the_grpcio_and_protobuf_installed_here() -> None:
    required = {}
    for name in PROTOS:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            path = ROOT / "shared" / "kubelet_api" / f"{name}{suffix}"
            required[path.name] = required_runtime(path.read_text())
    assert all(required.values()), {k: v for k, v in required.items() if not v}  # the parser found every pin
    assert runtime_mismatches() == []


SAMPLE_GRPC = """import grpc
import warnings

GRPC_GENERATED_VERSION = '1.85.4'
GRPC_VERSION = grpc.__version__
"""
SAMPLE_PB2 = """_runtime_version.ValidateProtobufRuntimeVersion(
    _runtime_version.Domain.PUBLIC,
    7,
    36,
    3,
    '',
    'shared/kubelet_api/deviceplugin.proto'
)
"""


def test_a_module_generated_for_a_newer_runtime_is_named_with_both_versions() -> None:
    required = {
        "deviceplugin_pb2_grpc.py": required_runtime(SAMPLE_GRPC),
        "deviceplugin_pb2.py": required_runtime(SAMPLE_PB2),
    }
    assert required == {"deviceplugin_pb2_grpc.py": {"grpcio": "1.85.4"}, "deviceplugin_pb2.py": {"protobuf": "7.36.3"}}
    problems = mismatches(required, {"grpcio": "1.85.3", "protobuf": "7.36.2"})
    assert len(problems) == 2, problems
    assert "deviceplugin_pb2_grpc.py was generated for grpcio>=1.85.4 but grpcio 1.85.3 is installed" in problems[1]
    assert "deviceplugin_pb2.py was generated for protobuf>=7.36.3 but protobuf 7.36.2" in problems[0]
    assert mismatches(required, {"grpcio": "1.85.4", "protobuf": "7.36.10"}) == []  # numeric, not text, order
    missing = mismatches(required, {"protobuf": "7.36.3"})
    assert missing == ["deviceplugin_pb2_grpc.py needs grpcio>=1.85.4, which is not installed"]


def test_pip_itself_and_the_build_requirements_are_pinned_and_applied() -> None:
    pins = _pinned()
    assert "pip" in pins, "constraints.txt pins pip itself"
    assert metadata.version("pip") == pins["pip"], "make install installs the pinned pip"
    assert "--upgrade pip" not in MAKEFILE
    assert re.search(r"^PIP_INSTALL = .*-m pip install .*-c \$\(CONSTRAINTS\)", MAKEFILE, re.M)
    assert re.search(r"^\t@\$\(PIP_INSTALL\) pip$", MAKEFILE, re.M), "pip is installed from constraints.txt"
    assert "--build-constraint $(CONSTRAINTS) -e '.[dev,test]'" in MAKEFILE
    assert "-m shared.kubelet_api --check" in MAKEFILE
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert build
    for text in build:
        req = Requirement(text)
        name = req.name.lower()
        assert name in pins, f"build requirement {req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name]), f"{req} excludes the pinned {pins[name]}"
    # the pinned grpcio-tools accepts the pinned grpcio and protobuf, so its modules load with them
    for dep in metadata.requires("grpcio-tools") or []:
        req = Requirement(dep)
        if req.marker is None and req.name.lower() in ("grpcio", "protobuf"):
            assert req.specifier.contains(pins[req.name.lower()]), f"grpcio-tools {pins['grpcio-tools']} needs {req}"
    assert metadata.version("grpcio-tools") == pins["grpcio-tools"]
