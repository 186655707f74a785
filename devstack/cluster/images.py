"""The container images of the local real nodes, made here (no registry is reachable): busybox and pause.

Each image is an OCI image layout tarball (`oci-layout`, `index.json`, `blobs/sha256/`: one gzip layer, its config
and manifest), written by the project's OCI writer (devstack/images/oci.py), which `ctr -n k8s.io images import`
reads; the index names the
image with containerd's `io.containerd.image.name` annotation, so it is imported under that name. Pods use them
with `imagePullPolicy: Never`.

- `BUSYBOX_IMAGE`: Debian's `busybox-static` (`/bin/busybox` and a link per applet `busybox --list` names), for
  test and demo workloads: `sh`, `env`, `sleep`, `cat`, ... The .deb is fetched with `apt-get download` (the
  machine's packages are left as they are).
- `PAUSE_IMAGE`: the sandbox image, `build/pause/linux/pause.c` of the `k8s.io/kubernetes` module compiled with
  `gcc -static` as its Makefile does; containerd's `pinned_images.sandbox` names it.

Both tarballs are cached in `${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/node-images/`, keyed by what went in.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import platform
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devstack.images.oci import BlobStore, ImageSpec, store_layer, write_archive

from . import build_modules
from .binaries import k8s_cache_dir
from .buildtools import (
    ControlPlaneUnavailable,
    Progress,
    apt_install,
    apt_lock,
    apt_update,
    cache_dir,
    can_apt,
    file_lock,
)
from .releases import Release

PAUSE_TAG = "3.10.2"  # build/pause/Makefile's TAG in k8s.io/kubernetes v1.37.2
PAUSE_IMAGE = f"gpushare.local/pause:{PAUSE_TAG}"
BUSYBOX_REPOSITORY = "gpushare.local/busybox"
BUSYBOX_PACKAGE = "busybox-static"
IMAGE_FORMAT = 2  # bumped when this module writes images differently: the cache then makes them anew
EPOCH = 0  # every file's mtime: the same inputs give the same digests

__all__ = ["BUSYBOX_REPOSITORY", "PAUSE_IMAGE", "Image", "busybox_image", "oci_archive", "pause_image"]


@dataclass(frozen=True)
class Image:
    """An image as an OCI archive on disk, and the name it is imported as."""

    name: str
    archive: Path


def go_arch() -> str:
    """This machine's architecture as OCI names it (amd64, arm64)."""
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


class Layer:
    """An uncompressed layer tar built in memory, deterministic (root-owned, mtime `EPOCH`)."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buffer, mode="w", format=tarfile.PAX_FORMAT)

    def _info(self, name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime, info.uid, info.gid = kind, mode, EPOCH, 0, 0
        return info

    def directory(self, name: str, mode: int = 0o755) -> None:
        """Add a directory."""
        self._tar.addfile(self._info(name, tarfile.DIRTYPE, mode))

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Add a regular file."""
        info = self._info(name, tarfile.REGTYPE, mode)
        info.size = len(data)
        self._tar.addfile(info, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        """Add a symbolic link."""
        info = self._info(name, tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self._tar.addfile(info)

    def close(self) -> bytes:
        """The tar's bytes."""
        self._tar.close()
        return self._buffer.getvalue()


def image_spec(config: dict[str, object]) -> ImageSpec:
    """An image config's runtime part (`Entrypoint`, `Cmd`, `Env` as K=V, `User`) as the OCI writer takes it."""
    env = [str(e) for e in config.get("Env", [])]  # type: ignore[attr-defined]
    return ImageSpec(
        entrypoint=tuple(str(a) for a in config.get("Entrypoint", [])),  # type: ignore[attr-defined]
        cmd=tuple(str(a) for a in config.get("Cmd", [])),  # type: ignore[attr-defined]
        env=dict(e.split("=", 1) for e in env),
        user=str(config.get("User", "")),
    )


def oci_archive(name: str, layer: bytes, config: dict[str, object], arch: str | None = None) -> bytes:
    """An OCI image layout tarball of one image `name` (`repo:tag`) with one `layer` (an uncompressed tar, stored
    gzip-compressed) and the runtime `config` (Entrypoint, Cmd, Env, User), written by the project's one OCI
    writer (devstack/images/oci.py)."""
    with tempfile.TemporaryDirectory(prefix="gpushare-oci-") as tmp:
        store = BlobStore(Path(tmp) / "blobs")
        written = store_layer(layer, store, comment="gpushare devstack/cluster/images.py")
        path = Path(tmp) / "image.tar"
        write_archive(path, name, image_spec(config), [written], store, architecture=arch or go_arch())
        return path.read_bytes()


def busybox_layer(busybox: bytes, applets: list[str]) -> bytes:
    """The busybox image's root filesystem: `/bin/busybox`, a link per applet in /bin, the usual empty folders, a
    root and a nobody user (pure)."""
    layer = Layer()
    for folder, mode in (("bin", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("root", 0o700), ("var", 0o755),
                         ("proc", 0o555), ("sys", 0o555), ("dev", 0o755)):  # fmt: skip
        layer.directory(folder, mode)
    layer.file("bin/busybox", busybox, 0o755)
    for applet in sorted(set(applets) - {"busybox"}):
        if applet and "/" not in applet:
            layer.symlink(f"bin/{applet}", "busybox")
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    layer.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    return layer.close()


def _busybox_deb(work: Path, progress: Progress) -> Path:
    """Debian's busybox-static .deb, downloaded into `work` (not installed)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ControlPlaneUnavailable(f"the busybox image needs Debian's {BUSYBOX_PACKAGE} (no apt-get/dpkg-deb here)")
    for attempt in range(2):
        with apt_lock(progress):
            res = subprocess.run(["apt-get", "download", BUSYBOX_PACKAGE], cwd=work, capture_output=True, text=True,
                                 check=False)  # fmt: skip
        debs = sorted(work.glob(f"{BUSYBOX_PACKAGE}_*.deb"))
        if res.returncode == 0 and debs:
            return debs[0]
        if attempt == 0 and can_apt():
            apt_update(progress, force=True)
    raise ControlPlaneUnavailable(f"apt-get download {BUSYBOX_PACKAGE} failed: {res.stderr.strip()[-500:]}")


def busybox_image(progress: Progress) -> Image:
    """Debian's busybox-static as an OCI archive (cached; the tag is the package's upstream version)."""
    folder = cache_dir() / "node-images"
    record = folder / f"busybox-f{IMAGE_FORMAT}.json"  # {"name": ..., "archive": ...} of the one made here
    with file_lock(folder / ".lock", progress):
        with contextlib.suppress(OSError, ValueError, KeyError):
            known = json.loads(record.read_text())
            if Path(known["archive"]).is_file():
                return Image(known["name"], Path(known["archive"]))
        with tempfile.TemporaryDirectory(prefix="gpushare-busybox-") as tmp:
            work = Path(tmp)
            progress(f"making the busybox image from Debian's {BUSYBOX_PACKAGE}")
            deb = _busybox_deb(work, progress)
            version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True,
                                     check=True).stdout.strip()  # fmt: skip
            subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
            binary = work / "root" / "bin" / "busybox"
            if not binary.is_file():
                raise ControlPlaneUnavailable(f"{deb.name} holds no bin/busybox")
            applets = subprocess.run([str(binary), "--list"], capture_output=True, text=True, check=True).stdout
            upstream = version.split(":", 1)[-1].split("-", 1)[0]  # 1:1.35.0-4+b3 -> 1.35.0
            name = f"{BUSYBOX_REPOSITORY}:{upstream}"
            data = oci_archive(name, busybox_layer(binary.read_bytes(), applets.split()), {
                "Cmd": ["sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            })  # fmt: skip
        key = hashlib.sha256(data).hexdigest()[:12]
        archive = folder / f"busybox-{upstream}-f{IMAGE_FORMAT}-{key}.tar"
        _write(archive, data)
        record.write_text(json.dumps({"name": name, "archive": str(archive)}) + "\n")
        progress(f"busybox image {name} ({len(data) // 1024} KiB) in {archive}")
        return Image(name, archive)


def pause_image(release: Release, progress: Progress) -> Image:
    """The pause image compiled from `release`'s `build/pause/linux/pause.c` (cached)."""
    folder = cache_dir() / "node-images"
    archive = folder / f"pause-{PAUSE_TAG}-{release.version}-f{IMAGE_FORMAT}.tar"
    if archive.is_file():
        return Image(PAUSE_IMAGE, archive)
    with file_lock(folder / ".lock", progress):
        if archive.is_file():
            return Image(PAUSE_IMAGE, archive)
        source = build_modules.release_file(
            k8s_cache_dir(release), release.version, "build/pause/linux/pause.c", progress
        )
        if shutil.which("gcc") is None:
            apt_install(["gcc", "libc6-dev"], progress)
        with tempfile.TemporaryDirectory(prefix="gpushare-pause-") as tmp:
            src, out = Path(tmp) / "pause.c", Path(tmp) / "pause"
            src.write_text(source)
            # the flags of build/pause/Makefile (CFLAGS), with our own version string
            cmd = ["gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{PAUSE_TAG}-gpushare", "-o", str(out),
                   str(src)]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode:
                raise ControlPlaneUnavailable(f"compiling pause.c failed: {res.stderr.strip()[-800:]}")
            layer = Layer()
            layer.file("pause", out.read_bytes(), 0o755)
            data = oci_archive(PAUSE_IMAGE, layer.close(), {"Entrypoint": ["/pause"], "User": "65535:65535"})
        _write(archive, data)
        progress(f"pause image {PAUSE_IMAGE} ({len(data) // 1024} KiB) in {archive}")
        return Image(PAUSE_IMAGE, archive)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
