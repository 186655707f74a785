"""Optional py-spy profiles of the services while one benchmark phase runs.

Set `GPUSHARE_BENCH_PYSPY=<dir>`: every `with phase_profiles("bind-pipeline"):` block then records each of
this benchmark's service processes (extender, binder, accounting, node agents) with `py-spy record` for the
block's duration, one raw flame-graph file per process (`<dir>/<phase>-<group>-<pid>.txt`). Unset, the block
costs nothing. py-spy comes with `pip install -e '.[profile]'`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.cpu import group_of, tree

PROFILED = ("extender", "binder", "accounting", "node-agent")
ENV = "GPUSHARE_BENCH_PYSPY"


def service_pids(groups: tuple[str, ...] = PROFILED) -> dict[int, str]:
    """This process's descendants that are gpushare services, with their group."""
    found = ((p.pid, group_of(p.command, p.pid)) for p in tree([os.getpid()]))
    return {pid: group for pid, group in found if group in groups}


@contextlib.contextmanager
def phase_profiles(phase: str, rate: int = 200) -> Iterator[None]:
    """Record the services with py-spy while the block runs, when GPUSHARE_BENCH_PYSPY names a folder."""
    target = os.environ.get(ENV)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not target or not Path(spy).exists():
        yield
        return
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    recorders = [
        subprocess.Popen(
            [
                spy,
                "record",
                "-p",
                str(pid),
                "-r",
                str(rate),
                "-f",
                "raw",
                "--nonblocking",
                "-o",
                str(out / f"{phase}-{group}-{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid, group in service_pids().items()
    ]
    try:
        yield
    finally:
        for r in recorders:
            r.send_signal(signal.SIGINT)
        for r in recorders:
            try:
                r.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.kill()
