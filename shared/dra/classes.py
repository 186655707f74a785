"""The DeviceClass of gpushare GPUs (pure): claims ask for it by name, it selects the devices of the driver."""

from __future__ import annotations

from typing import Any

from shared.dra import DEVICE_CLASS, DRIVER


def device_class(name: str = DEVICE_CLASS) -> dict[str, Any]:
    """`resource.k8s.io/v1` DeviceClass whose requests only the gpushare driver's devices satisfy."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
