"""The kubelet gRPC APIs the node agent speaks, compiled from the project's own `.proto` files.

`deviceplugin.proto` is kubelet's device plugin API (package `v1beta1`), `podresources.proto` its
pod-resources API (package `v1`). The generated `*_pb2*.py` modules are build output (not committed):
`python -m shared.kubelet_api` writes them, and `load()` writes them on the fly when missing or
older than their `.proto`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the directory holding the `shared` package
PROTOS = ("deviceplugin", "podresources")
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # where kubelet looks for device plugin sockets
KUBELET_SOCKET = "kubelet.sock"  # kubelet's registration socket, in the device plugin directory
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"  # kubelet's pod-resources API
PACKAGE = __name__


def _generated(name: str) -> list[Path]:
    return [HERE / f"{name}_pb2.py", HERE / f"{name}_pb2_grpc.py"]


def _stale(name: str) -> bool:
    source = HERE / f"{name}.proto"
    outputs = _generated(name)
    return any(not p.exists() or p.stat().st_mtime < source.stat().st_mtime for p in outputs)


def compile_protos(*, force: bool = False) -> list[str]:
    """Compile the `.proto` files with grpcio-tools into this package; returns what was compiled.

    Idempotent: up-to-date outputs are left alone unless `force`. Raises RuntimeError naming the file
    when protoc fails.
    """
    from grpc_tools import protoc  # imported here: only needed when compiling

    include = Path(protoc.__file__).resolve().parent / "_proto"
    done = []
    for name in PROTOS:
        if not force and not _stale(name):
            continue
        rel = (HERE / f"{name}.proto").relative_to(ROOT)
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={ROOT}",
                f"--pyi_out={ROOT}",
                f"--grpc_python_out={ROOT}",
                str(rel),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed on {rel} (exit {code})")
        done.append(name)
    importlib.invalidate_caches()
    return done


def load(name: str) -> tuple[ModuleType, ModuleType]:
    """The (messages, services) modules of one API, compiling first when needed."""
    if name not in PROTOS:
        raise ValueError(f"unknown proto {name!r}; known: {', '.join(PROTOS)}")
    if f"{PACKAGE}.{name}_pb2" not in sys.modules and _stale(name):
        compile_protos()
    pb2 = importlib.import_module(f"{PACKAGE}.{name}_pb2")
    grpc_mod = importlib.import_module(f"{PACKAGE}.{name}_pb2_grpc")
    return pb2, grpc_mod
