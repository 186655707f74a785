"""Build Kubernetes 1.20 from Debian's `kubernetes` source package with Debian's Go 1.19.

The 1.20 source was written for Go 1.15. The machine's newest Go (first on PATH) cannot build it, so the build
runs with Debian's toolchain at `/usr/lib/go-1.19/bin` and refuses to fall back to another. Even with Go 1.19
the `github.com/modern-go/reflect2` v1.0.1 that 1.20 vendors breaks on Go >= 1.18 (kube-apiserver dies under
load with "unexpected fault address" in `mapiterinit`), so the vendored copy is replaced with 1.0.2 (Debian's
golang-github-modern-go-reflect2-dev, the same API) before building.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from .buildtools import (
    ControlPlaneUnavailable,
    Progress,
    apt_install,
    apt_lock,
    apt_update,
    can_apt,
    executables_ok,
    run,
    run_apt,
)

GO_ROOT = Path("/usr/lib/go-1.19")
GO_PACKAGE = "golang-1.19-go"
REFLECT2_PACKAGE = "golang-github-modern-go-reflect2-dev"
REFLECT2_SOURCE = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
REFLECT2_VENDORED = Path("vendor/github.com/modern-go/reflect2")
REFLECT2_STAMP = ".gpushare-reflect2-1.0.2"
DEB_SRC_FILE = Path("/etc/apt/sources.list.d/gpushare-deb-src.sources")
DEB_SRC_CONTENT = """\
# Added by gpushare devcluster: source packages for building kube binaries.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def go19_bin() -> Path:
    """Debian's Go 1.19 toolchain folder (`ensure_build_deps` installs it)."""
    return GO_ROOT / "bin"


def ensure_build_deps(progress: Progress) -> None:
    """Debian's Go 1.19, reflect2 1.0.2, rsync, dpkg-dev and make."""
    missing = []
    if not (go19_bin() / "go").is_file():
        missing.append(GO_PACKAGE)
    if not (REFLECT2_SOURCE / "reflect2.go").is_file():
        missing.append(REFLECT2_PACKAGE)
    missing += [
        pkg
        for pkg, tool in (("rsync", "rsync"), ("dpkg-dev", "dpkg-source"), ("make", "make"))
        if shutil.which(tool) is None
    ]
    if missing:
        progress(f"installing build dependencies: {' '.join(missing)}")
        apt_install(missing, progress)
    version = subprocess.run([str(go19_bin() / "go"), "version"], capture_output=True, text=True, check=False)
    if "go1.19" not in version.stdout:
        raise ControlPlaneUnavailable(
            f"Kubernetes 1.20 needs Debian's Go 1.19 at {go19_bin()}, found: {version.stdout.strip() or version.stderr}"
        )


def _ensure_deb_src(progress: Progress) -> None:
    if DEB_SRC_FILE.exists():
        return
    if not can_apt():
        raise ControlPlaneUnavailable("need a deb-src entry but cannot write apt sources (not root)")
    with apt_lock(progress):
        if DEB_SRC_FILE.exists():
            return
        progress(f"adding {DEB_SRC_FILE}")
        DEB_SRC_FILE.write_text(DEB_SRC_CONTENT)
        apt_update(progress, force=True)


def fetch_source(root: Path, progress: Progress) -> Path:
    """Download and unpack the kubernetes orig tarball; return the source tree."""
    src_dir = root / "src"
    tree = src_dir / "kubernetes"
    if (tree / "Makefile").is_file() and (tree / "vendor").is_dir():
        return tree
    dl = root / "download"
    dl.mkdir(parents=True, exist_ok=True)
    origs = sorted(dl.glob("kubernetes_*.orig.tar.*"))
    if not origs:
        _ensure_deb_src(progress)
        apt_update(progress)
        run_apt(["apt-get", "source", "--download-only", "-q", "kubernetes"], progress, cwd=dl)
        origs = sorted(dl.glob("kubernetes_*.orig.tar.*"))
        if not origs:
            raise ControlPlaneUnavailable(f"apt-get source gave no orig tarball in {dl}")
    orig = origs[0]
    progress(f"unpacking {orig.name}")
    if src_dir.exists():
        shutil.rmtree(src_dir)
    src_dir.mkdir(parents=True)
    with tarfile.open(orig) as tf:
        tf.extractall(src_dir, filter="tar")  # Debian's archive
    tops = [p for p in src_dir.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise ControlPlaneUnavailable(f"unexpected layout in {orig}: {tops}")
    tops[0].rename(tree)
    return tree


def replace_reflect2(tree: Path, progress: Progress) -> None:
    """Swap the vendored reflect2 1.0.1 for Debian's 1.0.2 (idempotent: a stamp file marks it done)."""
    vendored = tree / REFLECT2_VENDORED
    if (vendored / REFLECT2_STAMP).is_file():
        return
    if not vendored.is_dir():
        raise ControlPlaneUnavailable(f"{vendored} not found: is this the Kubernetes 1.20 source?")
    for old in vendored.iterdir():
        if old.suffix in (".go", ".s"):
            old.unlink()
    copied = 0
    for new in REFLECT2_SOURCE.iterdir():
        if new.suffix in (".go", ".s") and not new.name.endswith("_test.go"):
            shutil.copy2(new, vendored / new.name)
            copied += 1
    if not (vendored / "go_above_118.go").is_file():
        raise ControlPlaneUnavailable(f"{REFLECT2_SOURCE} is not reflect2 1.0.2 (no go_above_118.go)")
    (vendored / REFLECT2_STAMP).write_text("vendored reflect2 replaced by Debian's 1.0.2\n")
    progress(f"replaced vendored reflect2 1.0.1 with 1.0.2 ({copied} files from {REFLECT2_SOURCE})")


def build(root: Path, version: str, components: tuple[str, ...], progress: Progress) -> Path:
    """Build `components` of Kubernetes `version` (1.20) under `root`; returns the folder holding them."""
    ensure_build_deps(progress)
    tree = fetch_source(root, progress)
    replace_reflect2(tree, progress)
    out_bin = tree / "_output" / "bin"
    stamp = out_bin / REFLECT2_STAMP
    if executables_ok(out_bin, components) and stamp.is_file():
        return out_bin
    env = {
        "PATH": f"{go19_bin()}:/usr/local/bin:/usr/bin:/bin",
        "GOROOT": str(GO_ROOT),
        "GOCACHE": str(root / "gocache"),
        "GOTOOLCHAIN": "local",
        "GOPROXY": "off",
        "GOFLAGS": "-buildvcs=false",
        "KUBE_GIT_VERSION": version,
        "KUBE_GIT_TREE_STATE": "clean",
    }
    log = root / "build.log"
    what = "WHAT=" + " ".join(f"cmd/{c}" for c in components)
    for attempt in (1, 2):
        if (tree / "_output").exists():
            progress("removing earlier _output")
            shutil.rmtree(tree / "_output")
        progress(
            f"building {', '.join(components)} {version} with Go 1.19 (attempt {attempt}; ~8 min on 2 cores; log {log})"
        )
        started = time.monotonic()
        try:
            run(
                ["make", what],
                progress,
                cwd=tree,
                env=env,
                log=log,
                heartbeat=lambda s: f"still building {version} ({s / 60:.0f} min so far; log {log})",
            )
        except ControlPlaneUnavailable:
            if attempt == 2:
                raise
            continue
        if executables_ok(out_bin, components):
            stamp.write_text("built with reflect2 1.0.2\n")
            progress(f"build finished in {time.monotonic() - started:.0f}s")
            return out_bin
        progress("build left empty/missing binaries; retrying")
    raise ControlPlaneUnavailable(f"build produced no usable binaries in {out_bin}; see {log}")
