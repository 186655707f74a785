"""What the control-plane builds share: the cache folder, progress lines, commands, apt (one command at a time on
the machine) and a build lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

Progress = Callable[[str], None]


class ControlPlaneUnavailable(RuntimeError):
    """The control-plane binaries cannot be obtained on this machine."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def stderr_progress(msg: str) -> None:
    """Default progress sink: one prefixed line on stderr."""
    print(f"[devcluster] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Root of the per-user cache (`GPUSHARE_CACHE_DIR` or ~/.cache/gpushare)."""
    env = os.environ.get("GPUSHARE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gpushare"


def executables_ok(bin_dir: Path, names: tuple[str, ...]) -> bool:
    """True when every one of `names` is a non-empty executable file in `bin_dir`."""
    for name in names:
        path = bin_dir / name
        if not (path.is_file() and path.stat().st_size > 0 and os.access(path, os.X_OK)):
            return False
    return True


def run(
    cmd: list[str],
    progress: Progress,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    heartbeat: Callable[[float], str] | None = None,
) -> None:
    """Run a command; on failure raise ControlPlaneUnavailable with its output tail.

    With `log`, output goes there and `heartbeat(elapsed_s)` (when given) is printed every 30 s, so a long
    build shows it is alive and how far it got.
    """
    progress("$ " + " ".join(cmd))
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("DEBIAN_FRONTEND", "noninteractive")
    try:
        if log is not None:
            with log.open("ab") as fh:
                proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=fh, stderr=subprocess.STDOUT)
                done = threading.Event()
                ticker = threading.Thread(target=_tick, args=(done, heartbeat, progress), daemon=True)
                if heartbeat is not None:
                    ticker.start()
                rc = proc.wait()
                done.set()
            tail = log.read_bytes()[-3000:].decode(errors="replace") if rc else ""
        else:
            res = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, check=False)
            rc = res.returncode
            tail = (res.stdout + res.stderr)[-3000:].decode(errors="replace")
    except FileNotFoundError as exc:
        raise ControlPlaneUnavailable(f"command not found: {cmd[0]} ({exc})") from exc
    if rc != 0:
        raise ControlPlaneUnavailable(f"command failed (exit {rc}): {' '.join(cmd)}\n{tail}")


def _tick(done: threading.Event, heartbeat: Callable[[float], str] | None, progress: Progress) -> None:
    started = time.monotonic()
    while heartbeat is not None and not done.wait(30.0):
        progress(heartbeat(time.monotonic() - started))


def can_apt() -> bool:
    """True when Debian packages can be installed here (root with apt-get)."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


APT_LOCK_ENV = "GPUSHARE_APT_LOCK"
APT_LISTS_FRESH_S = 900.0
"""An `apt-get update` by any process on this machine within this many seconds serves the next one's need."""

_apt_held = threading.local()


def apt_lock_path() -> Path:
    """The machine-wide lock every apt command here runs under (`GPUSHARE_APT_LOCK`, else /run/lock's, else /tmp's).

    apt itself refuses, not waits, when another apt holds its lists or dpkg lock, so builds in several processes
    (test workers, `make run` beside a test) take this lock first.
    """
    env = os.environ.get(APT_LOCK_ENV)
    if env:
        return Path(env).expanduser()
    run_lock = Path("/run/lock")
    folder = run_lock if run_lock.is_dir() and os.access(run_lock, os.W_OK) else Path(tempfile.gettempdir())
    return folder / "gpushare-apt.lock"


@contextmanager
def apt_lock(progress: Progress) -> Iterator[None]:
    """Hold the machine-wide apt lock (re-entrant within one thread): one apt command at a time on this machine."""
    depth = getattr(_apt_held, "depth", 0)
    with contextlib.nullcontext() if depth else file_lock(apt_lock_path(), progress):
        _apt_held.depth = depth + 1
        try:
            yield
        finally:
            _apt_held.depth = depth


def run_apt(cmd: list[str], progress: Progress, *, cwd: Path | None = None) -> None:
    """`run` an apt command under the machine-wide apt lock."""
    with apt_lock(progress):
        run(cmd, progress, cwd=cwd)


def apt_install(pkgs: list[str], progress: Progress) -> None:
    """Install Debian packages (updating the lists first unless they are fresh), under the machine-wide apt lock."""
    if not can_apt():
        raise ControlPlaneUnavailable(f"need Debian packages {' '.join(pkgs)} but apt-get is unavailable or not root")
    with apt_lock(progress):
        apt_update(progress)
        run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs], progress)


def _lists_stamp() -> Path:
    lock = apt_lock_path()
    return lock.with_name(lock.name + ".updated")


def apt_update(progress: Progress, *, force: bool = False) -> None:
    """`apt-get update` under the machine-wide apt lock; skipped when any process here updated the lists within
    APT_LISTS_FRESH_S, unless `force`."""
    with apt_lock(progress):
        stamp = _lists_stamp()
        if not force and stamp.is_file() and time.time() - stamp.stat().st_mtime < APT_LISTS_FRESH_S:
            return
        run(["apt-get", "update", "-q"], progress)
        stamp.touch()


@contextmanager
def file_lock(path: Path, progress: Progress) -> Iterator[None]:
    """Hold an exclusive lock on `path` (another process building the same thing waits)."""
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
