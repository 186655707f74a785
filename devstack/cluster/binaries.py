"""Obtain etcd and a Kubernetes release's control-plane binaries, idempotently.

kube-apiserver, kube-scheduler and kube-controller-manager are built once per release (see `releases`) and cached
outside the repository in `${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/k8s-<version>/bin`: a second run is free. Set
`GPUSHARE_K8S_BIN_DIR` to a folder holding prebuilt binaries of the selected release to skip the build entirely.

etcd is the one each release is tested with (its `build/dependencies.yaml`; v1.37.2: 3.7.0), built once from the
Go module `go.etcd.io/etcd/server/v3` (`build_etcd`) and cached in `<cache>/etcd-v<version>/bin`; 1.20 runs on
Debian's `etcd-server` (3.4), as it did. `GPUSHARE_ETCD_BIN` names an etcd binary to use instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import build_debian, build_etcd, build_modules
from .buildtools import (
    ControlPlaneUnavailable,
    Progress,
    apt_install,
    cache_dir,
    executables_ok,
    file_lock,
    stderr_progress,
)
from .releases import CURRENT, Release, selected_release

KUBE_COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
ETCD_CANDIDATES = ("/usr/bin/etcd",)
ETCD_BIN_ENV = "GPUSHARE_ETCD_BIN"
ETCD_VERSION_FILE = "etcd-version"  # in a release's cache folder: the etcd version it is tested with

__all__ = [
    "KUBE_COMPONENTS",
    "ControlPlaneUnavailable",
    "Paths",
    "Progress",
    "ensure_binaries",
    "ensure_etcd",
    "ensure_kube_binaries",
    "etcd_cache_dir",
    "k8s_cache_dir",
    "stderr_progress",
]


@dataclass(frozen=True)
class Paths:
    """Absolute paths of the binaries the dev control plane runs, and the release they are."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    release: Release = CURRENT


def k8s_cache_dir(release: Release) -> Path:
    """Folder holding one release's build and binaries."""
    return cache_dir() / f"k8s-{release.version}"


def debian_etcd(progress: Progress = stderr_progress) -> Path:
    """Debian's etcd (3.4, for 1.20), installing `etcd-server` via apt if needed."""
    found = shutil.which("etcd") or next((c for c in ETCD_CANDIDATES if os.access(c, os.X_OK)), None)
    if found:
        return Path(found)
    progress("etcd not found; installing Debian package etcd-server")
    apt_install(["etcd-server"], progress)
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if not found:
        raise ControlPlaneUnavailable("etcd-server installed but no etcd binary found")
    return Path(found)


def etcd_cache_dir(version: str) -> Path:
    """Folder holding one etcd version's build and binary."""
    return cache_dir() / f"etcd-v{version}"


def tested_etcd_version(release: Release, progress: Progress = stderr_progress) -> str:
    """The etcd version `release` is tested with (its `build/dependencies.yaml`), remembered in its cache folder."""
    root = k8s_cache_dir(release)
    remembered = root / ETCD_VERSION_FILE
    if remembered.is_file():
        return remembered.read_text().strip()
    text = build_modules.release_file(root, release.version, "build/dependencies.yaml", progress)
    try:
        version = build_etcd.tested_etcd_version(text)
    except ValueError as exc:
        raise ControlPlaneUnavailable(f"Kubernetes {release.version}: {exc}") from None
    remembered.write_text(version + "\n")
    return version


def ensure_etcd(release: Release | None = None, progress: Progress = stderr_progress) -> Path:
    """The etcd binary `release` runs on: `GPUSHARE_ETCD_BIN`, Debian's for 1.20, else the tested version, built
    (once, under a file lock) from the Go module."""
    override = os.environ.get(ETCD_BIN_ENV)
    if override:
        path = Path(override).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ControlPlaneUnavailable(f"{ETCD_BIN_ENV}={path} is not an executable file")
        return path
    release = release or selected_release()
    if release.from_debian_source:
        return debian_etcd(progress)
    version = tested_etcd_version(release, progress)
    root = etcd_cache_dir(version)
    binary = root / "bin" / "etcd"
    stamp = root / "bin" / ".complete"
    if stamp.is_file() and executables_ok(binary.parent, ("etcd",)):
        return binary
    with file_lock(root / ".lock", progress):
        if stamp.is_file() and executables_ok(binary.parent, ("etcd",)):
            return binary
        built = build_etcd.build(root, version, progress)
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.parent / ".etcd.tmp"
        shutil.copy2(built / "etcd", tmp)
        tmp.chmod(0o755)
        tmp.replace(binary)
        stamp.write_text(f"etcd {version} built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        progress(f"cached etcd {version} in {binary.parent}")
        return binary


def binary_version(binary: Path) -> str:
    """What `binary --version` reports (`Kubernetes v1.37.2` -> `v1.37.2`), '' when it cannot tell."""
    res = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    words = (res.stdout or res.stderr).split()
    return words[-1] if words else ""


def ensure_kube_binaries(release: Release | None = None, progress: Progress = stderr_progress) -> Path:
    """Return the folder holding the three kube binaries of `release`, building them if needed."""
    release = release or selected_release()
    override = os.environ.get("GPUSHARE_K8S_BIN_DIR")
    if override:
        bin_dir = Path(override).expanduser()
        if not executables_ok(bin_dir, KUBE_COMPONENTS):
            missing = [c for c in KUBE_COMPONENTS if not (bin_dir / c).is_file()]
            raise ControlPlaneUnavailable(
                f"GPUSHARE_K8S_BIN_DIR={bin_dir} lacks usable binaries: {missing or 'not executable'}"
            )
        return bin_dir
    root = k8s_cache_dir(release)
    bin_dir = root / "bin"
    stamp = bin_dir / ".complete"
    if stamp.is_file() and executables_ok(bin_dir, KUBE_COMPONENTS):
        return bin_dir
    with file_lock(root / ".lock", progress):
        if stamp.is_file() and executables_ok(bin_dir, KUBE_COMPONENTS):
            return bin_dir
        started = time.monotonic()
        builder = build_debian if release.from_debian_source else build_modules
        out_bin = builder.build(root, release.version, KUBE_COMPONENTS, progress)
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in KUBE_COMPONENTS:
            tmp = bin_dir / f".{name}.tmp"
            shutil.copy2(out_bin / name, tmp)
            tmp.chmod(0o755)
            tmp.replace(bin_dir / name)
        reported = binary_version(bin_dir / "kube-apiserver")
        if reported != release.version:
            raise ControlPlaneUnavailable(f"built kube-apiserver reports {reported!r}, expected {release.version}")
        stamp.write_text(f"{release.version} built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        progress(f"cached Kubernetes {release.version} in {bin_dir} ({time.monotonic() - started:.0f}s)")
        return bin_dir


def ensure_binaries(release: Release | None = None, progress: Progress = stderr_progress) -> Paths:
    """Obtain etcd and the kube binaries of `release` (default: `GPUSHARE_K8S_VERSION`, else the current one).

    Cached after the first call. Raises ControlPlaneUnavailable naming exactly what is missing.
    """
    release = release or selected_release()
    bin_dir = ensure_kube_binaries(release, progress)
    etcd = ensure_etcd(release, progress)
    return Paths(
        etcd=etcd,
        kube_apiserver=bin_dir / "kube-apiserver",
        kube_scheduler=bin_dir / "kube-scheduler",
        kube_controller_manager=bin_dir / "kube-controller-manager",
        release=release,
    )


def main(argv: list[str] | None = None) -> int:
    """CLI (`python -m devstack.cluster [--version V]`): obtain the binaries, print their paths."""
    import argparse

    from .releases import VERSION_ENV, parse_release

    parser = argparse.ArgumentParser(
        prog="python -m devstack.cluster",
        description="Build (once) and cache etcd and the Kubernetes control-plane binaries; print their paths.",
    )
    parser.add_argument(
        "--version",
        default=None,
        help=f"'current' (default), '1.20', or an exact v1.N.P (also {VERSION_ENV})",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        release = parse_release(args.version) if args.version else selected_release()
        paths = ensure_binaries(release)
    except (ControlPlaneUnavailable, ValueError) as exc:
        stderr_progress(f"unavailable: {getattr(exc, 'reason', exc)}")
        return 1
    for field, value in paths.__dict__.items():
        print(f"{field}={value}")
    stderr_progress(f"ready in {time.monotonic() - started:.1f}s")
    return 0
