"""System tools some tests need (kubectl, Chromium): found on PATH or installed with apt, idempotently.

When a tool cannot be had the test skips with the reason, or fails under `CI=true` (CI must not skip).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.cluster import ControlPlane, ControlPlaneUnavailable, Paths, buildtools, ensure_binaries
from devstack.cluster.releases import COMPAT, Release


def in_ci() -> bool:
    """True when running under CI (`CI=true`): missing tools fail instead of skipping."""
    return os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> None:
    """Skip with `reason`, or fail under CI."""
    if in_ci():
        pytest.fail(reason)
    pytest.skip(reason)


def apt_install(package: str) -> str | None:
    """`apt-get install -y package` under devstack's machine-wide apt lock; None on success, else the error."""
    try:
        buildtools.apt_install([package], lambda _msg: None)
    except ControlPlaneUnavailable as exc:
        return exc.reason[-500:]
    return None


def ensure_tool(names: tuple[str, ...], package: str) -> str:
    """Path of the first of `names` on PATH, installing Debian's `package` when none is there."""
    for name in names:
        if found := shutil.which(name):
            return found
    error = apt_install(package)
    for name in names:
        if found := shutil.which(name):
            return found
    unavailable(f"{names[0]} unavailable and `apt-get install {package}` failed: {error}")
    raise AssertionError("unreachable")


def control_plane_binaries(release: Release | None = None) -> Paths:
    """etcd and the kube binaries of `release` (default: GPUSHARE_K8S_VERSION, else the current release), built
    and cached on first use, or skip / fail with the reason."""
    try:
        return ensure_binaries(release)
    except ControlPlaneUnavailable as exc:
        unavailable(f"Kubernetes {release or 'control plane'} unavailable: {exc.reason}")
        raise


def compat_binaries() -> Paths:
    """etcd and the Kubernetes 1.20 binaries of the compatibility run."""
    return control_plane_binaries(COMPAT)


def monitoring_binaries() -> tuple[Path, Path]:
    """Prometheus and prometheus-adapter, installed or built and cached on first use (minutes on a new machine),
    so that a test's time limit covers running them, not building them; skip / fail with the reason."""
    from devstack.monitoring.adapter_build import ensure_adapter
    from devstack.monitoring.prometheus import ensure_prometheus

    try:
        return ensure_prometheus(), ensure_adapter()
    except ControlPlaneUnavailable as exc:
        unavailable(f"monitoring unavailable: {exc.reason}")
        raise


@contextlib.contextmanager
def running_control_plane(paths: Paths | None = None, **options: Any) -> Iterator[ControlPlane]:
    """A started `ControlPlane` (options as for its constructor), stopped afterwards; skip / fail when it
    cannot start."""
    cp = ControlPlane(paths=paths or control_plane_binaries(), **options)
    try:
        cp.start()
    except ControlPlaneUnavailable as exc:
        unavailable(f"Kubernetes control plane failed to start: {exc.reason}")
    try:
        yield cp
    finally:
        cp.stop()


def listening_addresses(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port`, IPv4 and IPv6 (/proc/net/tcp and tcp6:
    state 0A is LISTEN; an address is written as 32-bit words in the host's little-endian order)."""
    out = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hexport = fields[1].partition(":")
            if fields[3] != "0A" or int(hexport, 16) != port:
                continue
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
            out.add(str(ipaddress.ip_address(raw)))
    return out
