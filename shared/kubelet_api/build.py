"""Compiling kubelet's `.proto` files into Python modules with grpcio-tools: when a wheel is built (`setup.py`)
and in a development checkout (`python -m shared.kubelet_api`), never at run time.

grpcio-tools is a build requirement (and in the `dev` extra), not a runtime dependency: an installed gpushare
carries the generated `*_pb2.py`, `*_pb2_grpc.py` and `*_pb2.pyi` modules and only imports them.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from pathlib import Path

from . import PROTOS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the directory holding the `shared` package
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def outputs(name: str, root: Path = ROOT) -> list[Path]:
    """The files compiling `name`.proto writes under `root`."""
    package = root / HERE.relative_to(ROOT)
    return [package / f"{name}{suffix}" for suffix in SUFFIXES]


def stale(name: str, root: Path = ROOT) -> bool:
    """Whether a generated file of `name` is missing under `root`, or older than its `.proto`."""
    source = HERE / f"{name}.proto"
    return any(not p.exists() or p.stat().st_mtime < source.stat().st_mtime for p in outputs(name, root))


def compile_protos(out_root: Path = ROOT, *, force: bool = False) -> list[str]:
    """Compile the `.proto` files into the `shared/kubelet_api/` package under `out_root` (the source tree by
    default, a wheel's build directory from `setup.py`); returns what was compiled.

    Idempotent: up-to-date outputs are left alone unless `force`. Raises RuntimeError naming the file when
    protoc fails.
    """
    from grpc_tools import protoc  # a build tool: only here

    include = Path(protoc.__file__).resolve().parent / "_proto"
    out_root = Path(out_root)
    (out_root / HERE.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
    done = []
    for name in PROTOS:
        if not force and not stale(name, out_root):
            continue
        rel = (HERE / f"{name}.proto").relative_to(ROOT)
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={out_root}",
                f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}",
                str(rel),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed on {rel} (exit {code})")
        done.append(name)
    importlib.invalidate_caches()
    return done


GRPC_PIN = re.compile(r"^GRPC_GENERATED_VERSION\s*=\s*['\"]([0-9][^'\"]*)['\"]", re.M)
PROTOBUF_PIN = re.compile(
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.\w+,\s*(\d+),\s*(\d+),\s*(\d+),\s*'([^']*)'"
)


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (`1.85.4` -> (1, 85, 4); a suffix such as `rc1` is dropped)."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def required_runtime(module_text: str) -> dict[str, str]:
    """The runtime versions one generated module demands (pure): `grpcio` from a `_pb2_grpc.py`'s
    GRPC_GENERATED_VERSION, `protobuf` from a `_pb2.py`'s ValidateProtobufRuntimeVersion call."""
    found = {}
    if grpc_pin := GRPC_PIN.search(module_text):
        found["grpcio"] = grpc_pin.group(1)
    if pb_pin := PROTOBUF_PIN.search(module_text):
        major, minor, patch, suffix = pb_pin.groups()
        found["protobuf"] = f"{major}.{minor}.{patch}{suffix}"
    return found


def mismatches(required: dict[str, dict[str, str]], installed: dict[str, str]) -> list[str]:
    """For each generated file (name -> what it requires), the requirements `installed` does not meet (pure)."""
    problems = []
    for filename, needs in sorted(required.items()):
        for package, minimum in sorted(needs.items()):
            have = installed.get(package)
            if have is None:
                problems.append(f"{filename} needs {package}>={minimum}, which is not installed")
            elif _release(have) < _release(minimum):
                problems.append(
                    f"{filename} was generated for {package}>={minimum} but {package} {have} is installed: "
                    f"the grpcio-tools that built it is newer than constraints.txt's {package} (regenerate with "
                    "the pinned grpcio-tools: `python -m shared.kubelet_api --force`)"
                )
    return problems


def runtime_mismatches(root: Path = ROOT) -> list[str]:
    """Each generated module under `root` that needs a newer grpcio or protobuf than this environment has."""
    package = root / HERE.relative_to(ROOT)
    required = {}
    for name in PROTOS:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            path = package / f"{name}{suffix}"
            if path.exists():
                required[path.name] = required_runtime(path.read_text())
    installed = {}
    for dist in ("grpcio", "protobuf"):
        try:
            installed[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return mismatches(required, installed)
