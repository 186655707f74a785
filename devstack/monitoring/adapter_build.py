"""Build prometheus-adapter from the Go module `sigs.k8s.io/prometheus-adapter` with the machine's Go, once.

The binary is cached in `${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/prometheus-adapter-<version>/bin/adapter`, like
the control plane (`devstack.cluster.build_modules`). A small wrapper module requires the adapter at `VERSION`,
so its own go.mod decides every dependency (its `k8s.io/*` modules stay at the versions it was released with);
`go mod tidy` resolves them and `go build` builds `cmd/adapter`. Set `GPUSHARE_ADAPTER_BIN` to a prebuilt
binary to skip the build.

v0.12.0 is the newest version the Go module proxy serves here (it lists none, and refuses later ones); it builds
with Go 1.26 against its k8s.io modules v0.30.0.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from devstack.cluster.build_modules import go_binary, go_version
from devstack.cluster.buildtools import (
    ControlPlaneUnavailable,
    Progress,
    cache_dir,
    executables_ok,
    file_lock,
    run,
    stderr_progress,
)

ADAPTER_MODULE = "sigs.k8s.io/prometheus-adapter"
ADAPTER_VERSION = "v0.12.0"
BINARY = "adapter"


def wrapper_go_mod(version: str) -> str:
    """The wrapper module's go.mod (pure)."""
    return f"module gpushare.local/adapterbuild\n\ngo 1.22.1\n\nrequire {ADAPTER_MODULE} {version}\n"


def tools_go() -> str:
    """A build-tagged file importing the adapter's command, so `go mod tidy` keeps what it needs (pure)."""
    return f'//go:build tools\n\npackage adapterbuild\n\nimport _ "{ADAPTER_MODULE}/cmd/adapter"\n'


def adapter_cache_dir(version: str = ADAPTER_VERSION) -> Path:
    """Folder holding one version's build and binary."""
    return cache_dir() / f"prometheus-adapter-{version}"


def ensure_adapter(version: str = ADAPTER_VERSION, progress: Progress = stderr_progress) -> Path:
    """The prometheus-adapter binary of `version`, built and cached on first use (a few minutes on 2 cores)."""
    override = os.environ.get("GPUSHARE_ADAPTER_BIN")
    if override:
        path = Path(override).expanduser()
        if not executables_ok(path.parent, (path.name,)):
            raise ControlPlaneUnavailable(f"GPUSHARE_ADAPTER_BIN={path} is not an executable file")
        return path
    root = adapter_cache_dir(version)
    bin_dir = root / "bin"
    stamp = bin_dir / ".complete"
    if stamp.is_file() and executables_ok(bin_dir, (BINARY,)):
        return bin_dir / BINARY
    with file_lock(root / ".lock", progress):
        if stamp.is_file() and executables_ok(bin_dir, (BINARY,)):
            return bin_dir / BINARY
        started = time.monotonic()
        built = _build(root, version, progress)
        bin_dir.mkdir(parents=True, exist_ok=True)
        tmp = bin_dir / f".{BINARY}.tmp"
        shutil.copy2(built, tmp)
        tmp.chmod(0o755)
        tmp.replace(bin_dir / BINARY)
        stamp.write_text(f"{version} built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        progress(f"cached prometheus-adapter {version} in {bin_dir} ({time.monotonic() - started:.0f}s)")
        return bin_dir / BINARY


def _build(root: Path, version: str, progress: Progress) -> Path:
    go = go_binary()
    have = go_version(go)
    work = root / "module"
    work.mkdir(parents=True, exist_ok=True)
    env = {"GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false"}
    (work / "go.mod").write_text(wrapper_go_mod(version))
    (work / "tools.go").write_text(tools_go())
    log = root / "build.log"
    progress(f"resolving the modules of {ADAPTER_MODULE} {version} (go mod tidy; log {log})")
    run([go, "mod", "tidy"], progress, cwd=work, env=env, log=log)
    out = work / "bin"
    out.mkdir(exist_ok=True)
    progress(f"building prometheus-adapter {version} with Go {'.'.join(map(str, have))} (~9 min on 2 cores, once)")

    def heartbeat(elapsed: float) -> str:
        compiled = sum(1 for line in log.read_text(errors="replace").splitlines() if line and " " not in line)
        return f"still building prometheus-adapter: {compiled} packages compiled, {elapsed // 60:.0f} min so far"

    run(
        [go, "build", "-v", "-trimpath", "-ldflags", "-s -w", "-o", f"{out}/", f"{ADAPTER_MODULE}/cmd/adapter"],
        progress,
        cwd=work,
        env=env,
        log=log,
        heartbeat=heartbeat,
    )
    if not executables_ok(out, (BINARY,)):
        raise ControlPlaneUnavailable(f"go build left no usable prometheus-adapter in {out}; see {log}")
    return out / BINARY


def main() -> int:
    """`python -m devstack.monitoring.adapter_build`: build (once) and print the binary's path."""
    try:
        print(ensure_adapter())
    except ControlPlaneUnavailable as exc:
        stderr_progress(f"prometheus-adapter unavailable: {exc.reason}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
