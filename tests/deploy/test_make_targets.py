"""The Makefile keeps kubelet's generated gRPC modules current: a `.proto` changed by a pull is compiled before the
next `make run`, `make test` or `make bench`, not only when the dependencies (the install stamp) change.

Checked with `make -n` on a copy of the Makefile and the `.proto` files beside an install stamp, so nothing is built.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("shared/kubelet_api")
COMPILE = "-m shared.kubelet_api"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout with the Makefile, an install stamp and generated modules as `make install` leaves them."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / PROTO_DIR).mkdir(parents=True)
    for proto in (ROOT / PROTO_DIR).glob("*.proto"):
        shutil.copy(proto, tmp_path / PROTO_DIR / proto.name)
    digest = hashlib.sha1((ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes()).hexdigest()
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    for proto in (tmp_path / PROTO_DIR).glob("*.proto"):
        (proto.parent / f"{proto.stem}_pb2.py").write_text("# generated\n")
    (venv / f".installed-{digest[:12]}").touch()
    return tmp_path


def _planned(checkout: Path, target: str) -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    done = subprocess.run([make, "-n", "-C", str(checkout), target], capture_output=True, text=True, check=True)
    return done.stdout


def _age(path: Path, seconds: int) -> None:
    stat = path.stat()
    os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))


@pytest.mark.parametrize(
    ("target", "command"),
    [("run", "-m services.cli up"), ("test", "-m pytest"), ("bench", "-m bench"), ("lint", "-m ruff check")],
)
def test_a_changed_proto_is_compiled_before_the_target_runs(checkout: Path, target: str, command: str) -> None:
    _age(checkout / PROTO_DIR / "podresources_pb2.py", 60)  # the .proto is newer: a pull changed it
    planned = _planned(checkout, target)
    assert COMPILE in planned and command in planned, planned
    assert planned.index(COMPILE) < planned.index(command), planned


def test_nothing_is_compiled_when_the_generated_modules_are_current(checkout: Path) -> None:
    for proto in (checkout / PROTO_DIR).glob("*.proto"):
        _age(proto, 60)
    planned = _planned(checkout, "bench")
    assert COMPILE not in planned, planned
    assert "-m bench" in planned
