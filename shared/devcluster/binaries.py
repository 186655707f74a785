"""Obtain etcd and the Kubernetes v1.20.2 control-plane binaries, idempotently.

etcd comes from Debian's ``etcd-server`` package.  kube-apiserver,
kube-scheduler and kube-controller-manager are built once from Debian's
``kubernetes`` source package and cached outside the repository in
``${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/k8s-v1.20.2/bin``.  Set
``GPUSHARE_K8S_BIN_DIR`` to a directory holding prebuilt binaries to skip the
build entirely.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

K8S_VERSION = "v1.20.2"
KUBE_COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
DEB_SRC_FILE = Path("/etc/apt/sources.list.d/gpushare-deb-src.sources")
DEB_SRC_CONTENT = """\
# Added by gpushare devcluster: source packages for building kube binaries.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
BUILD_DEPS = ("golang-go", "rsync", "dpkg-dev", "make")
ETCD_CANDIDATES = ("/usr/bin/etcd",)

Progress = Callable[[str], None]


class ControlPlaneUnavailable(RuntimeError):
    """The control-plane binaries cannot be obtained on this machine."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Paths:
    """Absolute paths of the binaries the dev control plane runs."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path


def stderr_progress(msg: str) -> None:
    """Default progress sink: one prefixed line on stderr."""
    print(f"[devcluster] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Root of the per-user cache (``GPUSHARE_CACHE_DIR`` or ~/.cache/gpushare)."""
    env = os.environ.get("GPUSHARE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gpushare"


def k8s_cache_dir() -> Path:
    """Directory holding the versioned Kubernetes build and binaries."""
    return cache_dir() / f"k8s-{K8S_VERSION}"


def _stamp(root: Path) -> Path:
    return root / "bin" / ".complete"


def _binaries_ok(bin_dir: Path) -> bool:
    for name in KUBE_COMPONENTS:
        p = bin_dir / name
        if not (p.is_file() and p.stat().st_size > 0 and os.access(p, os.X_OK)):
            return False
    return True


def _run(
    cmd: list[str],
    progress: Progress,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> None:
    """Run a command; on failure raise ControlPlaneUnavailable with its output tail."""
    progress("$ " + " ".join(cmd))
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("DEBIAN_FRONTEND", "noninteractive")
    try:
        if log is not None:
            with log.open("ab") as fh:
                rc = subprocess.run(
                    cmd, cwd=cwd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, check=False
                ).returncode
            tail = log.read_bytes()[-3000:].decode(errors="replace") if rc else ""
        else:
            res = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, check=False)
            rc = res.returncode
            tail = (res.stdout + res.stderr)[-3000:].decode(errors="replace")
    except FileNotFoundError as exc:
        raise ControlPlaneUnavailable(f"command not found: {cmd[0]} ({exc})") from exc
    if rc != 0:
        raise ControlPlaneUnavailable(f"command failed (exit {rc}): {' '.join(cmd)}\n{tail}")


def _can_apt() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


_apt_updated = False


def _apt_install(pkgs: list[str], progress: Progress) -> None:
    global _apt_updated
    if not _can_apt():
        raise ControlPlaneUnavailable(f"need Debian packages {' '.join(pkgs)} but apt-get is unavailable or not root")
    if not _apt_updated:
        _run(["apt-get", "update", "-q"], progress)
        _apt_updated = True
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs], progress)


def ensure_etcd(progress: Progress = stderr_progress) -> Path:
    """Return the etcd binary, installing ``etcd-server`` via apt if needed."""
    found = shutil.which("etcd") or next((c for c in ETCD_CANDIDATES if os.access(c, os.X_OK)), None)
    if found:
        return Path(found)
    progress("etcd not found; installing Debian package etcd-server")
    _apt_install(["etcd-server"], progress)
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if not found:
        raise ControlPlaneUnavailable("etcd-server installed but no etcd binary found")
    return Path(found)


@contextmanager
def _file_lock(path: Path, progress: Progress) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another build holding {path}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure_build_deps(progress: Progress) -> None:
    missing = [
        p
        for p, tool in (("golang-go", "go"), ("rsync", "rsync"), ("dpkg-dev", "dpkg-source"), ("make", "make"))
        if shutil.which(tool) is None
    ]
    if missing:
        progress(f"installing build dependencies: {' '.join(missing)}")
        _apt_install(missing, progress)


def _ensure_deb_src(progress: Progress) -> None:
    global _apt_updated
    if DEB_SRC_FILE.exists():
        return
    if not _can_apt():
        raise ControlPlaneUnavailable("need a deb-src entry but cannot write apt sources (not root)")
    progress(f"adding {DEB_SRC_FILE}")
    DEB_SRC_FILE.write_text(DEB_SRC_CONTENT)
    _apt_updated = False


def _fetch_source(root: Path, progress: Progress) -> Path:
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
        global _apt_updated
        if not _apt_updated:
            _run(["apt-get", "update", "-q"], progress)
            _apt_updated = True
        _run(["apt-get", "source", "--download-only", "-q", "kubernetes"], progress, cwd=dl)
        origs = sorted(dl.glob("kubernetes_*.orig.tar.*"))
        if not origs:
            raise ControlPlaneUnavailable(f"apt-get source gave no orig tarball in {dl}")
    orig = origs[0]
    progress(f"unpacking {orig.name}")
    if src_dir.exists():
        shutil.rmtree(src_dir)
    src_dir.mkdir(parents=True)
    with tarfile.open(orig) as tf:
        tf.extractall(src_dir)  # trusted Debian archive
    tops = [p for p in src_dir.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise ControlPlaneUnavailable(f"unexpected layout in {orig}: {tops}")
    tops[0].rename(tree)
    return tree


def _build(root: Path, progress: Progress) -> None:
    _ensure_build_deps(progress)
    tree = _fetch_source(root, progress)
    out_bin = tree / "_output" / "bin"
    env = {
        "GOCACHE": str(root / "gocache"),
        "GOTOOLCHAIN": "local",
        "GOPROXY": "off",
        "KUBE_GIT_VERSION": K8S_VERSION,
        "KUBE_GIT_TREE_STATE": "clean",
    }
    log = root / "build.log"
    what = "WHAT=" + " ".join(f"cmd/{c}" for c in KUBE_COMPONENTS)
    for attempt in (1, 2):
        if (tree / "_output").exists() and not _binaries_ok(out_bin):
            progress("removing incomplete _output")
            shutil.rmtree(tree / "_output")
        progress(
            f"building {', '.join(KUBE_COMPONENTS)} {K8S_VERSION} (attempt {attempt}; ~7 min on 2 cores; log {log})"
        )
        t0 = time.monotonic()
        try:
            _run(["make", what], progress, cwd=tree, env=env, log=log)
        except ControlPlaneUnavailable:
            if attempt == 2:
                raise
            continue
        if _binaries_ok(out_bin):
            progress(f"build finished in {time.monotonic() - t0:.0f}s")
            return
        progress("build left empty/missing binaries; retrying")
    raise ControlPlaneUnavailable(f"build produced no usable binaries in {out_bin}; see {log}")


def ensure_kube_binaries(progress: Progress = stderr_progress) -> Path:
    """Return the directory holding the three kube binaries, building if needed."""
    override = os.environ.get("GPUSHARE_K8S_BIN_DIR")
    if override:
        bin_dir = Path(override).expanduser()
        if not _binaries_ok(bin_dir):
            missing = [c for c in KUBE_COMPONENTS if not (bin_dir / c).is_file()]
            raise ControlPlaneUnavailable(
                f"GPUSHARE_K8S_BIN_DIR={bin_dir} lacks usable binaries: {missing or 'not executable'}"
            )
        return bin_dir
    root = k8s_cache_dir()
    bin_dir = root / "bin"
    if _stamp(root).is_file() and _binaries_ok(bin_dir):
        return bin_dir
    with _file_lock(root / ".lock", progress):
        if _stamp(root).is_file() and _binaries_ok(bin_dir):
            return bin_dir
        out_bin = root / "src" / "kubernetes" / "_output" / "bin"
        if not _binaries_ok(out_bin):
            _build(root, progress)
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in KUBE_COMPONENTS:
            tmp = bin_dir / f".{name}.tmp"
            shutil.copy2(out_bin / name, tmp)
            tmp.chmod(0o755)
            tmp.replace(bin_dir / name)
        _stamp(root).write_text(f"{K8S_VERSION} built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        progress(f"cached kube binaries in {bin_dir}")
        return bin_dir


def ensure_binaries(progress: Progress = stderr_progress) -> Paths:
    """Obtain etcd and the kube binaries (cached after the first call).

    Raises ControlPlaneUnavailable naming exactly what is missing.
    """
    etcd = ensure_etcd(progress)
    bin_dir = ensure_kube_binaries(progress)
    return Paths(
        etcd=etcd,
        kube_apiserver=bin_dir / "kube-apiserver",
        kube_scheduler=bin_dir / "kube-scheduler",
        kube_controller_manager=bin_dir / "kube-controller-manager",
    )


def main() -> int:
    """CLI (``python -m shared.devcluster``): obtain the binaries, print their paths."""
    t0 = time.monotonic()
    try:
        paths = ensure_binaries()
    except ControlPlaneUnavailable as exc:
        stderr_progress(f"unavailable: {exc.reason}")
        return 1
    for field, value in paths.__dict__.items():
        print(f"{field}={value}")
    stderr_progress(f"ready in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
