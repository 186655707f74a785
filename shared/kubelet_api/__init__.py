"""The kubelet gRPC APIs the node agent speaks, generated from the project's `.proto` files.

`deviceplugin.proto` is kubelet's device plugin API (package `v1beta1`), `podresources.proto` its
pod-resources API (package `v1`); for Dynamic Resource Allocation, `pluginregistration.proto` is the registration
API of kubelet's plugin watcher, `dra_v1.proto` / `dra_v1beta1.proto` the DRA plugin service and
`drahealth_v1.proto` / `drahealth_v1alpha1.proto` the device health stream. The generated `*_pb2*.py` modules
are build output (not committed): building the wheel writes them into it (`setup.py`), and
`python -m shared.kubelet_api` into a development checkout (`shared.kubelet_api.build`). `load()` only imports
them: nothing is compiled or written at run time.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

PROTOS = (
    "deviceplugin",
    "podresources",
    "pluginregistration",
    "dra_v1",
    "dra_v1beta1",
    "drahealth_v1",
    "drahealth_v1alpha1",
)
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # where kubelet looks for device plugin sockets
KUBELET_SOCKET = "kubelet.sock"  # kubelet's registration socket, in the device plugin directory
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"  # kubelet's pod-resources API
PACKAGE = __name__


class StubsMissing(RuntimeError):
    """The generated gRPC modules are not installed (a checkout that was never built)."""


def load(name: str) -> tuple[ModuleType, ModuleType]:
    """The (messages, services) modules of one API."""
    if name not in PROTOS:
        raise ValueError(f"unknown proto {name!r}; known: {', '.join(PROTOS)}")
    try:
        pb2 = importlib.import_module(f"{PACKAGE}.{name}_pb2")
        grpc_mod = importlib.import_module(f"{PACKAGE}.{name}_pb2_grpc")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith(f"{PACKAGE}.{name}_pb2"):
            raise
        raise StubsMissing(
            f"the kubelet gRPC modules ({name}_pb2) are not built: they are generated when the gpushare wheel is "
            "built; in a development checkout run `python -m shared.kubelet_api` (or `make install`)"
        ) from None
    return pb2, grpc_mod
