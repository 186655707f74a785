"""Build a current Kubernetes release from the Go module `k8s.io/kubernetes` with the machine's Go.

`k8s.io/kubernetes` requires its ~30 staging modules (`k8s.io/api`, `k8s.io/client-go`, ...) at `v0.0.0` and maps
them to `./staging/...`, which only works inside the Kubernetes repository. A small wrapper module requires
`k8s.io/kubernetes v1.N.P` and replaces each of those with its published `v0.N.P`; `go build` then builds the
commands, with the version stamped through `k8s.io/component-base/version` so the binaries report it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from .buildtools import ControlPlaneUnavailable, Progress, executables_ok, run

_REPLACE_RE = re.compile(r"^\s*(k8s\.io/[A-Za-z0-9._/-]+)\s+=>\s+\./staging/", re.MULTILINE)
_GO_DIRECTIVE_RE = re.compile(r"^go\s+(\d+)\.(\d+)", re.MULTILINE)


def go_binary() -> str:
    """The `go` command on PATH; ControlPlaneUnavailable when there is none."""
    found = shutil.which("go")
    if not found:
        raise ControlPlaneUnavailable("building a current Kubernetes needs Go on PATH (none found)")
    return found


def go_version(go: str) -> tuple[int, int]:
    """(major, minor) of the Go toolchain `go`."""
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", out)
    if not match:
        raise ControlPlaneUnavailable(f"cannot tell the version of {go} (go env GOVERSION said {out!r})")
    return int(match.group(1)), int(match.group(2))


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The `k8s.io/*` modules that `k8s.io/kubernetes`'s go.mod maps to its staging folder (pure)."""
    return sorted(set(_REPLACE_RE.findall(kubernetes_go_mod)))


def wrapper_go_mod(version: str, staging: list[str], go_directive: str) -> str:
    """The wrapper module's go.mod: require `k8s.io/kubernetes` and pin every staging module (pure)."""
    published = "v0." + version.removeprefix("v").split(".", 1)[1]
    lines = [
        "module gpushare.local/kubebuild",
        "",
        f"go {go_directive}",
        "",
        f"require k8s.io/kubernetes {version}",
        "",
        "replace (",
        *(f"\t{m} => {m} {published}" for m in staging),
        ")",
        "",
    ]
    return "\n".join(lines)


def version_ldflags(version: str) -> str:
    """`-ldflags` that stamp the release into `k8s.io/component-base/version` (pure)."""
    major, minor = version.removeprefix("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return " ".join(
        [
            "-s -w",
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    )


def _download(go: str, version: str, work: Path, env: dict[str, str], progress: Progress) -> dict[str, str]:
    """`go mod download -json k8s.io/kubernetes@<version>`: where the module's go.mod and source tree are."""
    progress(f"fetching k8s.io/kubernetes@{version} from the Go module proxy")
    res = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        cwd=work,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        info = json.loads(res.stdout)
    except json.JSONDecodeError:
        info = {}
    if res.returncode or info.get("Error") or not info.get("GoMod") or not info.get("Dir"):
        detail = info.get("Error") or res.stderr.strip()[-1500:]
        raise ControlPlaneUnavailable(
            f"k8s.io/kubernetes@{version} is not available from the Go module proxy: {detail}"
        )
    return info


def _download_go_mod(go: str, version: str, work: Path, env: dict[str, str], progress: Progress) -> str:
    return Path(_download(go, version, work, env, progress)["GoMod"]).read_text()


def release_file(root: Path, version: str, path: str, progress: Progress) -> str:
    """The text of one file of the `k8s.io/kubernetes` module at `version` (e.g. `build/dependencies.yaml`),
    from the Go module cache (downloaded when missing; `root` is the release's cache folder)."""
    work = root / "module"
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "go.mod").is_file():
        (work / "go.mod").write_text("module gpushare.local/kubebuild\n\ngo 1.21\n")
    env = {"GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false"}
    source = Path(_download(go_binary(), version, work, env, progress)["Dir"]) / path
    try:
        return source.read_text()
    except OSError as exc:
        raise ControlPlaneUnavailable(f"k8s.io/kubernetes@{version} has no readable {path}: {exc}") from None


def build(root: Path, version: str, components: tuple[str, ...], progress: Progress) -> Path:
    """Build `components` of Kubernetes `version` under `root`; returns the folder holding them."""
    go = go_binary()
    work = root / "module"
    out_bin = work / "bin"
    if executables_ok(out_bin, components):
        return out_bin
    work.mkdir(parents=True, exist_ok=True)
    env = {"GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false"}
    (work / "go.mod").write_text("module gpushare.local/kubebuild\n\ngo 1.21\n")
    kube_mod = _download_go_mod(go, version, work, env, progress)
    wanted = _GO_DIRECTIVE_RE.search(kube_mod)
    have = go_version(go)
    if wanted and have < (int(wanted.group(1)), int(wanted.group(2))):
        raise ControlPlaneUnavailable(
            f"Kubernetes {version} needs Go >= {wanted.group(1)}.{wanted.group(2)}; {go} is {have[0]}.{have[1]}"
        )
    directive = f"{wanted.group(1)}.{wanted.group(2)}.0" if wanted else "1.21"
    (work / "go.mod").write_text(wrapper_go_mod(version, staging_modules(kube_mod), directive))
    imports = "\n".join(f'\t_ "k8s.io/kubernetes/cmd/{c}"' for c in components)
    (work / "tools.go").write_text(f"//go:build tools\n\npackage kubebuild\n\nimport (\n{imports}\n)\n")
    log = root / "build.log"
    progress(f"resolving the modules of Kubernetes {version} (go mod tidy; log {log})")
    run([go, "mod", "tidy"], progress, cwd=work, env=env, log=log)
    out_bin.mkdir(exist_ok=True)
    started = time.monotonic()
    progress(
        f"building {', '.join(components)} {version} with {'.'.join(map(str, have))} "
        f"(~10 min on 2 cores, once; log {log})"
    )

    def heartbeat(elapsed: float) -> str:
        compiled = sum(1 for line in log.read_text(errors="replace").splitlines() if line and " " not in line)
        spent = f"{elapsed // 60:.0f} min {elapsed % 60:02.0f} s"
        return f"still building {version}: {compiled} packages compiled, {spent} so far"

    run(
        [
            go,
            "build",
            "-v",
            "-trimpath",
            "-ldflags",
            version_ldflags(version),
            "-o",
            str(out_bin) + "/",
            *(f"k8s.io/kubernetes/cmd/{c}" for c in components),
        ],
        progress,
        cwd=work,
        env=env,
        log=log,
        heartbeat=heartbeat,
    )
    if not executables_ok(out_bin, components):
        raise ControlPlaneUnavailable(f"go build left no usable binaries in {out_bin}; see {log}")
    progress(f"build finished in {time.monotonic() - started:.0f}s")
    return out_bin
