"""A root filesystem from Debian's binary packages, without dpkg, chroot scripts or a container engine.

The packages come from the machine's apt sources (Debian 12 "bookworm", deb.debian.org): `apt-cache policy` gives
the version apt would install (the candidate), `apt-get download` fetches that exact version into the cache, and
each `.deb` (an `ar` archive whose `data.tar.*` is the package's files) is unpacked here. Maintainer scripts do
not run: an image needs the files, not a configured system. Debian 12 installs merge `/bin`, `/sbin` and `/lib*`
into `/usr`; the unpacking does the same (files of `lib/...` go to `usr/lib/...`, and `lib` is a link to
`usr/lib`), so absolute links such as `/lib64/ld-linux-x86-64.so.2` resolve.

Documentation, manual pages and translations are left out; each package's `copyright` file stays.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from devstack.cluster.buildtools import ControlPlaneUnavailable, Progress, apt_lock, apt_update, can_apt, run_apt

# Debian 12's merged /usr: a package's bin/, sbin/, lib/... land under usr/, and these links point there.
MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Left out of every image: documentation, manual pages, translations and packaging data (each copyright stays).
LEFT_OUT = (
    "usr/share/doc/",
    "usr/share/man/",
    "usr/share/info/",
    "usr/share/locale/",
    "usr/share/lintian/",
    "usr/share/bug/",
    "usr/share/doc-base/",
    "usr/share/bash-completion/",
    "etc/init.d/",
    "etc/logrotate.d/",
    "usr/lib/systemd/",
)
KEPT = re.compile(r"usr/share/doc/[^/]+/copyright")

__all__ = ["DebianPackage", "candidates", "download", "unpack", "unpack_all"]


@dataclass(frozen=True)
class DebianPackage:
    """One binary package at one version, and its file once downloaded."""

    name: str
    version: str

    @property
    def pin(self) -> str:
        return f"{self.name}={self.version}"

    def filename(self) -> str:
        """The name `apt-get download` gives the file (epochs are written %3a)."""
        return f"{self.name}_{self.version.replace(':', '%3a')}_"


def parse_policy(text: str) -> dict[str, str]:
    """Package name -> candidate version from `apt-cache policy P...` output ("(none)" left out) (pure)."""
    out: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1].split(":", 1)[0] if line.count(":") > 1 else line[:-1]
        elif line.strip().startswith("Candidate:") and current:
            version = line.split(":", 1)[1].strip()
            if version != "(none)":
                out[current] = version
    return out


def candidates(names: Iterable[str], progress: Progress) -> list[DebianPackage]:
    """The version apt would install of each of `names` (updating apt's lists once when one is unknown)."""
    wanted = sorted(set(names))
    if shutil.which("apt-cache") is None:
        raise ControlPlaneUnavailable("apt-cache is not available: the images are built from Debian's packages")

    def policy() -> dict[str, str]:
        with apt_lock(progress):
            res = subprocess.run(["apt-cache", "policy", *wanted], capture_output=True, text=True, timeout=120,
                                 check=False)  # fmt: skip
        return parse_policy(res.stdout)

    found = policy()
    if set(wanted) - set(found) and can_apt():
        apt_update(progress)
        found = policy()
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ControlPlaneUnavailable(
            f"apt knows no installable version of {', '.join(missing)}: the images need Debian 12 (bookworm) sources"
        )
    return [DebianPackage(name, found[name]) for name in wanted]


def download(packages: Iterable[DebianPackage], folder: Path, progress: Progress) -> dict[DebianPackage, Path]:
    """Each package's `.deb` in `folder`, downloaded once (`apt-get download name=version`)."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[DebianPackage, Path] = {}
    todo = []
    for pkg in packages:
        found = sorted(folder.glob(pkg.filename() + "*.deb"))
        if found:
            out[pkg] = found[0]
        else:
            todo.append(pkg)
    if todo:
        progress(f"downloading {len(todo)} Debian packages into {folder}")
        try:
            run_apt(["apt-get", "download", "-q", *(p.pin for p in todo)], progress, cwd=folder)
        except ControlPlaneUnavailable as exc:
            if not can_apt():
                raise
            # a point release replaced a version the lists still name: fetch them again, so that a rerun resolves
            # (and downloads) the versions the mirror serves now
            apt_update(progress, force=True)
            raise ControlPlaneUnavailable(
                f"{exc.reason}\napt's package lists were out of date and are refreshed now: build again"
            ) from exc
        for pkg in todo:
            found = sorted(folder.glob(pkg.filename() + "*.deb"))
            if not found:
                raise ControlPlaneUnavailable(f"apt-get download left no file for {pkg.pin} in {folder}")
            out[pkg] = found[0]
    return out


def ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, content) of each member of an `ar` archive (a .deb's outer format) (pure)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with !<arch>)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)  # members are aligned to even offsets


def image_path(member: str) -> PurePosixPath | None:
    """Where a package's file goes in the image (merged /usr), or None when it is left out (pure)."""
    rel = member.removeprefix("./").rstrip("/")
    if not rel or rel == ".":
        return None
    first, _, rest = rel.partition("/")
    if first in MERGED_USR:
        rel = f"usr/{first}" + (f"/{rest}" if rest else "")
    if rel.startswith(LEFT_OUT) and not KEPT.fullmatch(rel):
        return None
    if any(rel + "/" == p for p in LEFT_OUT):
        return None
    return PurePosixPath(rel)


def _data_tar(deb: Path) -> tarfile.TarFile:
    for name, content in ar_members(deb.read_bytes()):
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise ControlPlaneUnavailable(f"{deb.name}: zstd-compressed data ({name}) is not supported")
            return tarfile.open(fileobj=io.BytesIO(content), mode="r:*")
    raise ControlPlaneUnavailable(f"{deb.name}: no data.tar member")


def merged_usr(root: Path) -> None:
    """The folders and links of Debian 12's merged /usr in `root`."""
    for name in MERGED_USR:
        if name in ("lib32", "libx32"):
            continue
        (root / "usr" / name).mkdir(parents=True, exist_ok=True)
        link = root / name
        if not link.is_symlink():
            link.symlink_to(f"usr/{name}")


def unpack(deb: Path, root: Path) -> list[PurePosixPath]:
    """Unpack one package's files into `root` (merged /usr, documentation left out); returns what it wrote."""
    written: list[PurePosixPath] = []
    with _data_tar(deb) as tar:
        for member in tar.getmembers():
            rel = image_path(member.name)
            if rel is None:
                continue
            target = root / rel
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                target.chmod(member.mode & 0o7777)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.exists():
                if target.is_dir() and not target.is_symlink():
                    continue
                target.unlink()
            if member.issym():
                target.symlink_to(member.linkname)
            elif member.islnk():
                source = image_path(member.linkname)
                if source is None:
                    raise ControlPlaneUnavailable(f"{deb.name}: hard link {member.name} to a left-out file")
                os.link(root / source, target)
            elif member.isfile():
                fh = tar.extractfile(member)
                assert fh is not None
                target.write_bytes(fh.read())
                target.chmod(member.mode & 0o7777 & ~(stat.S_ISUID | stat.S_ISGID))
            else:
                continue  # device nodes and fifos: none in the packages an image needs
            written.append(rel)
    return written


def unpack_all(debs: Mapping[DebianPackage, Path], root: Path) -> dict[str, list[PurePosixPath]]:
    """Every package unpacked into `root` (with merged /usr); package name -> its files."""
    root.mkdir(parents=True, exist_ok=True)
    merged_usr(root)
    return {pkg.name: unpack(path, root) for pkg, path in sorted(debs.items(), key=lambda kv: kv[0].name)}
