"""Obtain the `helm` binary (Helm v4) for the chart's tests, idempotently.

Built once from the Go module `helm.sh/helm/v4` with the machine's Go (as `build_modules` builds Kubernetes) and
cached outside the repository in `${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/helm-<version>/bin/helm`; a second
run is free, and a file lock makes a concurrent caller wait for the first build instead of building twice.
Set `GPUSHARE_HELM` to a prebuilt `helm` of that version to skip the build.

    python -m devstack.cluster.helm        # build (once) and print the path
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .build_modules import go_binary, go_version
from .buildtools import ControlPlaneUnavailable, Progress, cache_dir, executables_ok, file_lock, run, stderr_progress

HELM_VERSION = "v4.3.2"
HELM_MODULE = "helm.sh/helm/v4"
HELM_ENV = "GPUSHARE_HELM"

__all__ = ["HELM_VERSION", "ensure_helm", "helm_cache_dir", "helm_version"]


def helm_cache_dir(version: str = HELM_VERSION) -> Path:
    """Folder holding one Helm version's build and binary."""
    return cache_dir() / f"helm-{version}"


def helm_ldflags(version: str) -> str:
    """`-ldflags` that stamp `version` into Helm's `internal/version` (as Helm's own Makefile does) (pure)."""
    pkg = f"{HELM_MODULE}/internal/version"
    return f"-s -w -X {pkg}.version={version} -X {pkg}.metadata= -X {pkg}.gitTreeState=clean"


def helm_version(binary: Path) -> str:
    """What `helm version --template` reports (`v4.3.2`), '' when it cannot tell."""
    res = subprocess.run(
        [str(binary), "version", "--template", "{{ .Version }}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return res.stdout.strip() if res.returncode == 0 else ""


def _build(root: Path, version: str, progress: Progress) -> Path:
    go = go_binary()
    work = root / "module"
    out_bin = work / "bin"
    if executables_ok(out_bin, ("helm",)):
        return out_bin
    work.mkdir(parents=True, exist_ok=True)
    env = {"GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false", "CGO_ENABLED": "0"}
    have = go_version(go)
    if have < (1, 26):
        raise ControlPlaneUnavailable(f"Helm {version} needs Go >= 1.26; {go} is {have[0]}.{have[1]}")
    (work / "go.mod").write_text(f"module gpushare.local/helmbuild\n\ngo 1.26.0\n\nrequire {HELM_MODULE} {version}\n")
    (work / "tools.go").write_text(f'//go:build tools\n\npackage helmbuild\n\nimport _ "{HELM_MODULE}/cmd/helm"\n')
    log = root / "build.log"
    progress(f"resolving the modules of Helm {version} (go mod tidy; log {log})")
    run([go, "mod", "tidy"], progress, cwd=work, env=env, log=log)
    out_bin.mkdir(exist_ok=True)
    progress(f"building helm {version} with Go {have[0]}.{have[1]} (a few minutes on 2 cores, once; log {log})")
    run(
        [
            go,
            "build",
            "-trimpath",
            "-ldflags",
            helm_ldflags(version),
            "-o",
            str(out_bin / "helm"),
            f"{HELM_MODULE}/cmd/helm",
        ],
        progress,
        cwd=work,
        env=env,
        log=log,
        heartbeat=lambda elapsed: f"still building helm {version}: {elapsed // 60:.0f} min {elapsed % 60:02.0f} s",
    )
    if not executables_ok(out_bin, ("helm",)):
        raise ControlPlaneUnavailable(f"go build left no usable helm in {out_bin}; see {log}")
    return out_bin


def ensure_helm(version: str = HELM_VERSION, progress: Progress = stderr_progress) -> Path:
    """Path of a `helm` binary of `version`, building and caching it on first use.

    Raises ControlPlaneUnavailable naming what is missing (no Go, the module proxy unreachable, a failed build).
    """
    override = os.environ.get(HELM_ENV)
    if override:
        path = Path(override).expanduser()
        if not executables_ok(path.parent, (path.name,)):
            raise ControlPlaneUnavailable(f"{HELM_ENV}={path} is not an executable file")
        return path
    root = helm_cache_dir(version)
    binary = root / "bin" / "helm"
    stamp = root / "bin" / ".complete"
    if stamp.is_file() and executables_ok(binary.parent, ("helm",)):
        return binary
    with file_lock(root / ".lock", progress):
        if stamp.is_file() and executables_ok(binary.parent, ("helm",)):
            return binary
        started = time.monotonic()
        built = _build(root, version, progress) / "helm"
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.parent / ".helm.tmp"
        tmp.write_bytes(built.read_bytes())
        tmp.chmod(0o755)
        tmp.replace(binary)
        reported = helm_version(binary)
        if reported != version:
            raise ControlPlaneUnavailable(f"built helm reports {reported!r}, expected {version}")
        stamp.write_text(f"{version} built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        progress(f"cached helm {version} in {binary} ({time.monotonic() - started:.0f}s)")
        return binary


def main() -> int:
    """Build (once) and print the path of helm."""
    try:
        print(ensure_helm())
    except ControlPlaneUnavailable as exc:
        stderr_progress(f"unavailable: {exc.reason}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
