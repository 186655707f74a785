"""What every image's root filesystem gets besides its packages (accounts, the folders a container runtime mounts
over, the CA bundle), and the build-time checks run inside it with `chroot` (root only): every ELF file finds its
libraries with the image's own loader, and commands run with the image's own programs."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devstack.cluster.buildtools import ControlPlaneUnavailable

LOADER = "/usr/lib64/ld-linux-x86-64.so.2"
CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
ELF_MAGIC = b"\x7fELF"

__all__ = [
    "Account",
    "chroot_run",
    "elf_files",
    "layout",
    "missing_libraries",
    "require_libraries",
    "write_accounts",
    "write_ca_bundle",
]


@dataclass(frozen=True)
class Account:
    """A user (and its group of the same id) in /etc/passwd and /etc/group."""

    name: str
    uid: int
    home: str = "/nonexistent"
    shell: str = "/usr/sbin/nologin"


def passwd_lines(accounts: Sequence[Account]) -> tuple[str, str]:
    """The text of /etc/passwd and /etc/group for root, `accounts` and nobody (pure)."""
    every = [Account("root", 0, "/root", "/bin/sh"), *accounts, Account("nobody", 65534)]
    passwd = "".join(f"{a.name}:x:{a.uid}:{a.uid}:{a.name}:{a.home}:{a.shell}\n" for a in every)
    group = "".join(f"{'nogroup' if a.uid == 65534 else a.name}:x:{a.uid}:\n" for a in every)
    return passwd, group


def write_accounts(root: Path, accounts: Sequence[Account]) -> None:
    """/etc/passwd, /etc/group and /etc/nsswitch.conf (programs such as initdb look their user up)."""
    passwd, group = passwd_lines(accounts)
    etc = root / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "passwd").write_text(passwd)
    (etc / "group").write_text(group)
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    for name in ("passwd", "group", "nsswitch.conf"):
        (etc / name).chmod(0o644)


def layout(root: Path) -> None:
    """The folders a container runtime mounts over or a program writes to: /tmp (sticky, everyone's), /proc,
    /sys, /dev, /run, /etc."""
    for name, mode in (("tmp", 0o1777), ("proc", 0o755), ("sys", 0o755), ("dev", 0o755), ("run", 0o755)):
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
    (root / "etc").mkdir(exist_ok=True)


def write_executable(path: Path, data: bytes) -> None:
    """`data` as an executable file at `path` (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o755)


def write_ca_bundle(root: Path) -> int:
    """/etc/ssl/certs/ca-certificates.crt from the certificates Debian's ca-certificates ships (its
    update-ca-certificates would write the same concatenation); returns how many it holds."""
    certs = sorted((root / "usr/share/ca-certificates").rglob("*.crt"))
    target = root / CA_BUNDLE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(c.read_text() for c in certs))
    return len(certs)


def chroot_run(
    root: Path,
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`cmd` run inside `root` with the image's own programs (`chroot`, root only), with only `env` set (the
    image has no `env` program: the environment is the chroot's own)."""
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    if os.geteuid() != 0 or not Path(chroot).is_file():
        raise ControlPlaneUnavailable("building an image runs its own programs with chroot: run as root")
    args = [chroot]
    if user:
        args.append(f"--userspec={user}")
    return subprocess.run(
        [*args, str(root), *cmd], env=dict(env or {}), capture_output=True, text=True, timeout=timeout, check=False
    )


def elf_files(root: Path, under: Iterable[str] = ("usr", "opt")) -> list[Path]:
    """Every regular file starting with the ELF magic under `root`'s folders `under`."""
    out = []
    for top in under:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                path = Path(dirpath) / name
                if path.is_symlink() or not path.is_file():
                    continue
                with path.open("rb") as fh:
                    if fh.read(4) == ELF_MAGIC:
                        out.append(path)
    return sorted(out)


def missing_libraries(root: Path, files: Iterable[Path], loader: str = LOADER) -> dict[str, list[str]]:
    """Image path -> the libraries it needs that the image lacks, asked of the image's own dynamic loader
    (`ld.so --list`, which follows RUNPATH and $ORIGIN as at run time); static programs need none."""
    missing: dict[str, list[str]] = {}
    inside = [("/" + str(f.relative_to(root))) for f in files]
    # a small shell loop inside the image would need a shell there: run the loader once per file instead
    for path in inside:
        res = chroot_run(root, [loader, "--list", path], timeout=60)
        if res.returncode != 0 and "not a dynamic executable" in (res.stdout + res.stderr):
            continue
        lost = [line.split("=>")[0].strip() for line in res.stdout.splitlines() if "not found" in line]
        if lost:
            missing[path] = lost
    return missing


def require_libraries(root: Path, under: Iterable[str]) -> None:
    """Fail, naming each program and library, when an ELF file under `root`'s folders `under` needs a library the
    image lacks."""
    missing = missing_libraries(root, elf_files(root, under))
    if missing:
        lines = "\n".join(f"  {path}: {', '.join(libs)}" for path, libs in sorted(missing.items()))
        raise ControlPlaneUnavailable(f"the image lacks libraries its programs load:\n{lines}")
