"""Build the etcd a Kubernetes release is tested with, from the Go module `go.etcd.io/etcd/server/v3`.

Each Kubernetes release names the etcd it is tested with in `build/dependencies.yaml` (the `etcd` entry;
v1.37.2: 3.7.0). kube-apiserver 1.37 on an older etcd (Debian's 3.4.23) logs storage consistency errors
("Too large resource version": its watch cache never learns etcd's current revision), so the local control plane
runs the tested version: a small wrapper module (`module gpushare.local/etcdbuild`, `go 1.25`) gets
`go.etcd.io/etcd/server/v3@v<version>` and `go build` builds its main package (about 40 s on 2 cores, once).
1.20 keeps Debian's etcd 3.4 (`binaries.ensure_etcd`).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from .build_modules import go_binary
from .buildtools import ControlPlaneUnavailable, Progress, executables_ok, run

ETCD_MODULE = "go.etcd.io/etcd/server/v3"
WRAPPER_MODULE = "gpushare.local/etcdbuild"
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")
_ENTRY_RE = re.compile(r"^\s*-\s*name:\s*[\"']?etcd[\"']?\s*$")
_FIELD_RE = re.compile(r"^\s*version:\s*[\"']?([0-9][0-9A-Za-z.+-]*)[\"']?\s*$")


def tested_etcd_version(dependencies_yaml: str) -> str:
    """The etcd version the `etcd` entry of a release's `build/dependencies.yaml` names (pure; ValueError if none)."""
    lines = dependencies_yaml.splitlines()
    for i, line in enumerate(lines):
        if not _ENTRY_RE.match(line):
            continue
        for field in lines[i + 1 :]:
            if field.lstrip().startswith("- "):  # the next entry: this one had no version
                break
            match = _FIELD_RE.match(field)
            if match:
                return match.group(1)
    raise ValueError("build/dependencies.yaml names no etcd version")


def wrapper_go_mod() -> str:
    """The wrapper module's go.mod before `go get` adds the etcd server module (pure)."""
    return f"module {WRAPPER_MODULE}\n\ngo 1.25\n"


def reported_version(binary: Path) -> str:
    """What `etcd --version` says its version is (`etcd Version: 3.7.0` -> `3.7.0`), '' when it cannot tell."""
    res = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    for line in (res.stdout or res.stderr).splitlines():
        if line.startswith("etcd Version:"):
            return line.split(":", 1)[1].strip()
    return ""


def build(root: Path, version: str, progress: Progress) -> Path:
    """Build etcd `version` under `root` (`root/module`); returns the folder holding the binary."""
    if not _VERSION_RE.match(version):
        raise ControlPlaneUnavailable(f"not an etcd release version: {version!r}")
    go = go_binary()
    work = root / "module"
    out_bin = work / "bin"
    if executables_ok(out_bin, ("etcd",)) and reported_version(out_bin / "etcd") == version:
        return out_bin
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text(wrapper_go_mod())
    (work / "go.sum").unlink(missing_ok=True)
    env = {"GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod -buildvcs=false"}
    log = root / "build.log"
    started = time.monotonic()
    progress(f"fetching {ETCD_MODULE}@v{version} from the Go module proxy (log {log})")
    run([go, "get", f"{ETCD_MODULE}@v{version}"], progress, cwd=work, env=env, log=log)
    progress(f"building etcd {version} (~40 s on 2 cores, once; log {log})")
    out_bin.mkdir(exist_ok=True)
    run([go, "build", "-trimpath", "-o", str(out_bin / "etcd"), ETCD_MODULE], progress, cwd=work, env=env, log=log)
    reported = reported_version(out_bin / "etcd") if executables_ok(out_bin, ("etcd",)) else ""
    if reported != version:
        raise ControlPlaneUnavailable(f"the etcd built from {ETCD_MODULE}@v{version} reports {reported!r}; see {log}")
    progress(f"etcd {version} built in {time.monotonic() - started:.0f}s")
    return out_bin
