"""Service subprocesses: start with a log file, wait until ready, stop (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from devstack.stack.spec import ServiceCommand

log = logging.getLogger(__name__)


class ServiceFailed(RuntimeError):
    """A service exited or never became ready; the message carries its log tail."""


class ServiceProcess:
    """One `gpushare <service>` subprocess writing to `log_path`."""

    def __init__(self, command: ServiceCommand, log_dir: Path) -> None:
        self.command = command
        self.log_path = log_dir / f"{command.name}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        """The service's name."""
        return self.command.name

    def start(self) -> None:
        """Spawn the process in its own session (so Ctrl-C reaches only the orchestrator)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.command.env}
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                self.command.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        log.info("started %s", self.name, extra={"service": self.name, "pid": self.popen.pid})

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, nbytes: int = 3000) -> str:
        """The end of the service's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll the ready URL until it answers 200; ServiceFailed when the process dies or time runs out."""
        url = self.command.ready_url
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.alive():
                    code = self.popen.returncode if self.popen else None
                    raise ServiceFailed(f"{self.name} exited with {code}; log {self.log_path}:\n{self.log_tail()}")
                if url is None:
                    return
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServiceFailed(
                        f"{self.name} not ready at {url} after {timeout_s:.0f}s; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL the process group."""
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs, killing it", self.name, grace_s, extra={"service": self.name})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        log.info("stopped %s", self.name, extra={"service": self.name, "returncode": self.popen.returncode})
