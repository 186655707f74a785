"""The Dockerfile's recipe: a slim non-root image whose build installs the package and compiles the protos.

No Docker engine runs here, so the build steps that matter are replayed: build the wheel from the files
the image receives, unpack it as site-packages, run the proto compilation from `/` as the Dockerfile does,
and start `gpushare --help` from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.deploy.tools import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()


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


def test_slim_non_root_read_only_friendly() -> None:
    steps = _instructions()
    froms = [s for s in steps if s.startswith("FROM ")]
    assert all(s.split()[1] == "python:3.11-slim" for s in froms)
    final = steps[len(steps) - steps[::-1].index(froms[-1]) :]  # instructions of the last stage
    user = [s for s in final if s.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in {"0", "root"}
    env = " ".join(s for s in final if s.startswith("ENV "))
    for setting in ("PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp", "TMPDIR=/tmp"):
        assert setting in env
    assert 'ENTRYPOINT ["gpushare"]' in final
    build = " ".join(steps)
    assert "pip install ." in build and "python -m shared.kubelet_api" in build


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "**/*_pb2.py"} <= ignored
    copied = {s.split()[1] for s in _instructions() if s.startswith("COPY ") and "--from" not in s}
    assert copied & ignored == set(), "the Dockerfile copies something .dockerignore drops"


def _copy_context(dest: Path) -> None:
    """The parts of the repository the image's build copies, without generated or cached files."""
    skip = shutil.ignore_patterns("__pycache__", "*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("shared", "services", "migrations"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)


def _isolation() -> list[str]:
    """Build with the venv's setuptools when it can make wheels by itself (>= 70.1), else let pip fetch one."""
    try:
        import setuptools
    except ImportError:
        return []
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return ["--no-build-isolation"] if (major, minor) >= (70, 1) else []


def test_wheel_holds_everything_and_protos_compile_into_it(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    _copy_context(context)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_isolation(), str(context)]
    proc = subprocess.run([*pip, "-w", str(wheels)], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = wheels.glob("gpushare-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(site)
    assert "shared/kubelet_api/deviceplugin.proto" in names
    assert any(n.startswith("migrations/versions/") for n in names)
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    compile_ = [sys.executable, "-m", "shared.kubelet_api", "--force"]
    proc = subprocess.run(compile_, cwd="/", env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (site / "shared/kubelet_api/deviceplugin_pb2.py").exists()
    check = "import shared.kubelet_api.deviceplugin_pb2 as m, services.cli as c; print(m.__file__, c.__file__)"
    proc = subprocess.run([sys.executable, "-c", check], cwd="/", env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.count(str(site)) == 2, proc.stdout + proc.stderr
