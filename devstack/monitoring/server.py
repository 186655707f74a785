"""What the monitoring servers share: one child process with its log, a readiness wait, and a stop."""

from __future__ import annotations

import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from devstack.cluster.buildtools import ControlPlaneUnavailable


def http_ok(url: str) -> bool:
    """True when GET `url` answers 200 (HTTPS without verifying the certificate)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class LocalServer:
    """A server process started by the stack or a test, logging to `log_path`."""

    name = "server"

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def spawn(self, args: list[str], ready: Callable[[], bool], timeout_s: float) -> None:
        """Start `args` and wait until `ready()`; ControlPlaneUnavailable with the log's end otherwise."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self._proc.poll() is not None:
                raise ControlPlaneUnavailable(f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ControlPlaneUnavailable(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, nbytes: int = 3000) -> str:
        """The end of the server's log."""
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); safe to call twice."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
