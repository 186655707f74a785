"""Obtain what a real local node runs: kubelet, containerd, runc and the project's CNI plugin, built once and cached.

- kubelet of the control plane's release: `cmd/kubelet` of `k8s.io/kubernetes`, with the control plane's wrapper
  module, flags and version stamp (`build_modules`), so the Go build cache the control plane filled is reused;
  cached in `kubelet-<version>/`;
- containerd, containerd-shim-runc-v2 and ctr: `go install` of `github.com/containerd/containerd/v2` at
  `CONTAINERD_VERSION` (its own go.mod decides every dependency), without cgo, as its Makefile builds the shim;
  `containerd-<version>/`;
- runc: `go install` of `github.com/opencontainers/runc` at `RUNC_VERSION` with libseccomp (Debian's
  `libseccomp-dev` and `pkg-config`, installed when missing); `runc-<version>/`;
- crictl (optional, for debugging): `sigs.k8s.io/cri-tools/cmd/crictl` at `CRICTL_VERSION`; `crictl-<version>/`;
- gpushare-loopback, the nodes' CNI plugin: `devstack/cluster/cni/` of this repository (Go's standard library
  only); `cni-<hash of its sources>/`.

All of them under `${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/`. Each build runs under a file lock (a second caller
waits, then finds the binaries), writes a `.complete` stamp only after the binaries report the pinned version, and
logs to `build.log` beside them. Nothing here starts a process
that stays.

    python -m devstack.cluster.node_build [--crictl]   # build (once) and print the paths
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import build_modules
from .buildtools import (
    ControlPlaneUnavailable,
    Progress,
    apt_install,
    cache_dir,
    executables_ok,
    file_lock,
    run,
    stderr_progress,
)
from .releases import Release, selected_release

CONTAINERD_VERSION = "v2.4.2"
CONTAINERD_MODULE = "github.com/containerd/containerd/v2"
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
RUNC_VERSION = "v1.5.3"
RUNC_MODULE = "github.com/opencontainers/runc"
RUNC_TAGS = "seccomp urfave_cli_no_docs"  # runc's Makefile's tags less `libpathrs` (a Rust library Debian lacks)
RUNC_PACKAGES = ("libseccomp-dev", "pkg-config")
CRICTL_VERSION = "v1.37.0"
CRICTL_MODULE = "sigs.k8s.io/cri-tools"
CNI_PLUGIN = "gpushare-loopback"
CNI_SOURCE = Path(__file__).resolve().parent / "cni"

__all__ = [
    "CONTAINERD_VERSION",
    "CRICTL_VERSION",
    "RUNC_VERSION",
    "NodeBinaries",
    "NodeUnavailable",
    "ensure_cni_plugin",
    "ensure_containerd",
    "ensure_crictl",
    "ensure_kubelet",
    "ensure_node_binaries",
    "ensure_runc",
]


class NodeUnavailable(ControlPlaneUnavailable):
    """A real node cannot run on this machine (a binary cannot be built, not root, no cgroups...): `reason` says
    which."""


@dataclass(frozen=True)
class NodeBinaries:
    """Absolute paths of what a real node runs."""

    kubelet: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    runc: Path
    cni_bin_dir: Path  # holds CNI_PLUGIN
    release: Release
    crictl: Path | None = None


def _go_env(**extra: str) -> dict[str, str]:
    return {"GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false", **extra}


def reported(binary: Path, *args: str) -> str:
    """What `binary args...` prints (stdout, else stderr), '' when it cannot run."""
    try:
        res = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return ""
    return res.stdout or res.stderr


def _cached(
    root: Path,
    names: tuple[str, ...],
    what: str,
    build: Callable[[Path, Path], None],
    check: Callable[[Path], str],
    progress: Progress,
) -> Path:
    """The bin folder of `root` holding `names`, built by `build(work, log)` into `root/bin` once, under
    `root/.lock`; `check(bin)` returns '' when the binaries are right, else what is wrong."""
    bin_dir = root / "bin"
    stamp = bin_dir / ".complete"
    if stamp.is_file() and executables_ok(bin_dir, names):
        return bin_dir
    with file_lock(root / ".lock", progress):
        if stamp.is_file() and executables_ok(bin_dir, names):
            return bin_dir
        started = time.monotonic()
        bin_dir.mkdir(parents=True, exist_ok=True)
        work = root / "work"
        work.mkdir(parents=True, exist_ok=True)
        build(work, root / "build.log")
        if not executables_ok(bin_dir, names):
            raise NodeUnavailable(
                f"the {what} build left no usable {', '.join(names)} in {bin_dir}; see {root}/build.log"
            )
        problem = check(bin_dir)
        if problem:
            raise NodeUnavailable(f"the {what} build is not what was pinned: {problem}; see {root}/build.log")
        stamp.write_text(f"{what} built {time.strftime('%Y-%m-%dT%H:%M:%S')} in {time.monotonic() - started:.0f}s\n")
        progress(f"cached {what} in {bin_dir} ({time.monotonic() - started:.0f}s)")
        return bin_dir


def _heartbeat(what: str) -> Callable[[float], str]:
    return lambda elapsed: f"still building {what}: {elapsed // 60:.0f} min {elapsed % 60:02.0f} s so far"


def _go_install(
    work: Path,
    log: Path,
    bin_dir: Path,
    packages: list[str],
    *,
    ldflags: str = "-s -w",
    tags: str = "",
    cgo: bool = False,
    what: str,
    progress: Progress,
) -> None:
    """`go install pkg@version...` into `bin_dir`: the module is the main module, so its own go.mod (with its
    replace directives, when it has any) decides every dependency, as in its own release build."""
    go = build_modules.go_binary()
    cmd = [go, "install", "-trimpath", "-ldflags", ldflags, *(["-tags", tags] if tags else []), *packages]
    env = _go_env(GOBIN=str(bin_dir), CGO_ENABLED="1" if cgo else "0")
    progress(f"building {what} (log {log})")
    run(cmd, progress, cwd=work, env=env, log=log, heartbeat=_heartbeat(what))


def kubelet_cache_dir(release: Release) -> Path:
    """Folder holding one release's kubelet build."""
    return cache_dir() / f"kubelet-{release.version}"


def ensure_kubelet(release: Release | None = None, progress: Progress = stderr_progress) -> Path:
    """kubelet of `release` (default: the selected one), built once from `k8s.io/kubernetes` like the control
    plane: the same wrapper module, flags and version stamp, in a folder of its own (so its lock never waits on a
    control-plane build), reusing the Go build cache the control plane filled."""
    release = release or selected_release()
    if release.from_debian_source:
        raise NodeUnavailable(f"real nodes run the current release; Kubernetes {release.version} has no kubelet build")
    root = kubelet_cache_dir(release)

    def build(work: Path, log: Path) -> None:
        out = build_modules.build(root, release.version, ("kubelet",), progress)
        shutil.copy2(out / "kubelet", root / "bin" / "kubelet")

    def check(bin_dir: Path) -> str:
        said = reported(bin_dir / "kubelet", "--version").split()
        return "" if said and said[-1] == release.version else f"kubelet --version says {' '.join(said)!r}"

    return _cached(root, ("kubelet",), f"kubelet {release.version}", build, check, progress) / "kubelet"


def ensure_containerd(progress: Progress = stderr_progress) -> Path:
    """The folder holding containerd, containerd-shim-runc-v2 and ctr of `CONTAINERD_VERSION`."""
    root = cache_dir() / f"containerd-{CONTAINERD_VERSION}"
    pkg = f"{CONTAINERD_MODULE}/version"
    stamp = f"-X {pkg}.Version={CONTAINERD_VERSION} -X {pkg}.Package={CONTAINERD_MODULE}"

    def build(work: Path, log: Path) -> None:
        at = f"@{CONTAINERD_VERSION}"
        daemon = [f"{CONTAINERD_MODULE}/cmd/{c}{at}" for c in ("containerd", "ctr")]
        what = f"containerd {CONTAINERD_VERSION} (~3 min on 2 cores, once)"
        # without cgo, as its Makefile builds the shim: the daemon then has no btrfs snapshotter (it needs btrfs
        # headers), which the local nodes never use (overlayfs)
        _go_install(work, log, root / "bin", daemon, ldflags=f"-s -w {stamp}", tags="urfave_cli_no_docs",
                    what=what, progress=progress)  # fmt: skip
        shim = [f"{CONTAINERD_MODULE}/cmd/containerd-shim-runc-v2{at}"]
        _go_install(work, log, root / "bin", shim, ldflags=f"-s -w {stamp}", tags="urfave_cli_no_docs no_grpc",
                    what=f"containerd-shim-runc-v2 {CONTAINERD_VERSION}", progress=progress)  # fmt: skip

    def check(bin_dir: Path) -> str:
        said = reported(bin_dir / "containerd", "--version")
        return "" if CONTAINERD_VERSION in said.split() else f"containerd --version says {said.strip()!r}"

    return _cached(root, CONTAINERD_BINARIES, f"containerd {CONTAINERD_VERSION}", build, check, progress)


def libseccomp_present() -> bool:
    """True when cgo can link libseccomp (its pkg-config file is installed)."""
    if shutil.which("pkg-config") is None:
        return False
    return subprocess.run(["pkg-config", "--exists", "libseccomp"], check=False).returncode == 0


def ensure_runc(progress: Progress = stderr_progress) -> Path:
    """runc of `RUNC_VERSION`, with seccomp (installing Debian's libseccomp-dev and pkg-config when missing)."""
    root = cache_dir() / f"runc-{RUNC_VERSION}"

    def build(work: Path, log: Path) -> None:
        if not libseccomp_present():
            progress(f"runc needs libseccomp: installing Debian's {' '.join(RUNC_PACKAGES)}")
            apt_install(list(RUNC_PACKAGES), progress)
        if shutil.which("gcc") is None:
            apt_install(["gcc", "libc6-dev"], progress)
        _go_install(work, log, root / "bin", [f"{RUNC_MODULE}@{RUNC_VERSION}"], tags=RUNC_TAGS, cgo=True,
                    what=f"runc {RUNC_VERSION} (~40 s, once)", progress=progress)  # fmt: skip

    def check(bin_dir: Path) -> str:
        said = reported(bin_dir / "runc", "--version")
        want = f"runc version {RUNC_VERSION.removeprefix('v')}"
        if want not in said:
            return f"runc --version says {said.strip()!r}"
        return "" if "libseccomp:" in said else "runc was built without libseccomp"

    return _cached(root, ("runc",), f"runc {RUNC_VERSION}", build, check, progress) / "runc"


def ensure_crictl(progress: Progress = stderr_progress) -> Path:
    """crictl of `CRICTL_VERSION` (a debugging aid: nothing the project runs needs it)."""
    root = cache_dir() / f"crictl-{CRICTL_VERSION}"
    stamp = f"-X {CRICTL_MODULE}/pkg/version.Version={CRICTL_VERSION}"

    def build(work: Path, log: Path) -> None:
        _go_install(work, log, root / "bin", [f"{CRICTL_MODULE}/cmd/crictl@{CRICTL_VERSION}"],
                    ldflags=f"-s -w {stamp}", what=f"crictl {CRICTL_VERSION}", progress=progress)  # fmt: skip

    def check(bin_dir: Path) -> str:
        said = reported(bin_dir / "crictl", "--version")
        return "" if CRICTL_VERSION.removeprefix("v") in said else f"crictl --version says {said.strip()!r}"

    return _cached(root, ("crictl",), f"crictl {CRICTL_VERSION}", build, check, progress) / "crictl"


def cni_source_hash(source: Path = CNI_SOURCE) -> str:
    """A short hash of the CNI plugin's sources (its go.mod and .go files): a changed plugin is built anew."""
    digest = hashlib.sha256()
    for path in sorted(p for p in source.iterdir() if p.suffix in (".go", ".mod")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def ensure_cni_plugin(progress: Progress = stderr_progress) -> Path:
    """The folder holding `gpushare-loopback`, built from `devstack/cluster/cni` (a second or two)."""
    root = cache_dir() / f"cni-{cni_source_hash()}"

    def build(work: Path, log: Path) -> None:
        go = build_modules.go_binary()
        out = root / "bin" / CNI_PLUGIN
        cmd = [go, "build", "-C", str(CNI_SOURCE), "-trimpath", "-ldflags", "-s -w", "-o", str(out), "."]
        run(cmd, progress, cwd=work, env=_go_env(CGO_ENABLED="0"), log=log)

    def check(bin_dir: Path) -> str:
        env = {**os.environ, "CNI_COMMAND": "VERSION"}
        res = subprocess.run(
            [str(bin_dir / CNI_PLUGIN)], input="", capture_output=True, text=True, env=env, check=False
        )
        return "" if '"supportedVersions"' in res.stdout else f"VERSION answered {res.stdout or res.stderr!r}"

    return _cached(root, (CNI_PLUGIN,), f"the {CNI_PLUGIN} CNI plugin", build, check, progress)


def ensure_node_binaries(
    release: Release | None = None, progress: Progress = stderr_progress, *, crictl: bool = False
) -> NodeBinaries:
    """Everything a real node runs, built on first use (minutes) and cached; NodeUnavailable naming what failed."""
    release = release or selected_release()
    try:
        kubelet = ensure_kubelet(release, progress)
        containerd = ensure_containerd(progress)
        runc = ensure_runc(progress)
        cni = ensure_cni_plugin(progress)
        crictl_path = ensure_crictl(progress) if crictl else None
    except NodeUnavailable:
        raise
    except ControlPlaneUnavailable as exc:
        raise NodeUnavailable(exc.reason) from None
    return NodeBinaries(
        kubelet=kubelet,
        containerd=containerd / "containerd",
        containerd_shim=containerd / "containerd-shim-runc-v2",
        ctr=containerd / "ctr",
        runc=runc,
        cni_bin_dir=cni,
        release=release,
        crictl=crictl_path,
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: build (once) and print the paths."""
    parser = argparse.ArgumentParser(
        prog="python -m devstack.cluster.node_build",
        description="Build (once) and cache kubelet, containerd, runc and the CNI plugin of the local real nodes.",
    )
    parser.add_argument("--crictl", action="store_true", help=f"also crictl {CRICTL_VERSION} (for debugging)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        paths = ensure_node_binaries(crictl=args.crictl)
    except NodeUnavailable as exc:
        stderr_progress(f"unavailable: {exc.reason}")
        return 1
    for field, value in paths.__dict__.items():
        print(f"{field}={value}")
    stderr_progress(f"ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
