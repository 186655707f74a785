"""The CDI spec the node agent writes for a prepared claim (pure).

kubelet hands a container the CDI device IDs that `NodePrepareResources` returned for the request the container
references (CRI `CDIDevices`; `GetResources` in pkg/kubelet/cm/dra/manager.go, v1.37.2), and the container
runtime applies the device's `containerEdits` from the spec file in its CDI directory. gpushare's devices only
set the environment: the same variables the device-plugin path hands a container (NVIDIA_VISIBLE_DEVICES,
gpushare's ALIYUN_COM_GPU_MEM_*, the memory limits), one CDI device per request of a claim, named after the
claim's UID so that no name is ever reused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

CDI_VERSION = "0.6.0"
VENDOR = "gpushare.io"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
_NAME = re.compile(r"[^a-zA-Z0-9_.:-]+")


def device_name(claim_uid: str, request: str) -> str:
    """The CDI device of one request of a claim."""
    return _NAME.sub("-", f"{claim_uid}-{request}")


def device_id(claim_uid: str, request: str) -> str:
    """The fully qualified CDI device ID kubelet passes to the runtime (`gpushare.io/claim=<uid>-<request>`)."""
    return f"{KIND}={device_name(claim_uid, request)}"


def spec_file_name(claim_uid: str) -> str:
    """The spec file of a claim in the CDI directory."""
    return f"{VENDOR}-{CLASS}_{_NAME.sub('-', claim_uid)}.json"


def cdi_spec(
    claim_uid: str,
    env_by_request: Mapping[str, Mapping[str, str]],
    mounts_by_request: Mapping[str, Sequence[tuple[str, str, bool]]] | None = None,
) -> dict[str, Any]:
    """The CDI spec of a prepared claim: one device per request, whose edits set that request's environment and,
    when given, bind mounts `(host path, container path, read only)` (an MPS client's directories, the GPU list
    as volume mounts)."""
    devices = []
    for request, env in env_by_request.items():
        edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(env.items())]}
        mounts = (mounts_by_request or {}).get(request) or []
        if mounts:
            edits["mounts"] = [
                {"hostPath": host, "containerPath": path, "options": ["ro" if ro else "rw", "bind"]}
                for host, path, ro in mounts
            ]
        devices.append({"name": device_name(claim_uid, request), "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices}


def env_of(spec: Mapping[str, Any], device: str) -> dict[str, str]:
    """The environment one device of a spec sets (what a container referencing it gets)."""
    for d in spec.get("devices") or []:
        if d.get("name") == device:
            return dict(item.split("=", 1) for item in (d.get("containerEdits") or {}).get("env") or [])
    raise KeyError(device)
