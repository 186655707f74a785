"""Compiling kubelet's `.proto` files into Python modules with grpcio-tools: when a wheel is built (`setup.py`)
and in a development checkout (`python -m shared.kubelet_api`), never at run time.

grpcio-tools is a build requirement (and in the `dev` extra), not a runtime dependency: an installed gpushare
carries the generated `*_pb2.py`, `*_pb2_grpc.py` and `*_pb2.pyi` modules and only imports them.
"""

from __future__ import annotations

import importlib
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
