"""apt from several processes at once, as parallel test workers building Kubernetes 1.20, etcd-server and the images
do on a new machine: apt refuses (exit 100, "Could not get lock /var/lib/apt/lists/lock") instead of waiting when
another apt holds its lists or dpkg lock, so devstack runs every apt command under one machine-wide lock."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from devstack.cluster import buildtools
from tests import system_tools

REPO = Path(__file__).resolve().parents[2]

UPDATE_AT = """
import sys, time
from devstack.cluster import buildtools
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
buildtools.apt_update(lambda msg: print(msg, flush=True), force=sys.argv[2] == "force")
"""


@pytest.fixture
def apt_root() -> None:
    if not buildtools.can_apt():
        system_tools.unavailable("these tests run apt-get as root")


def _update_at(start: float, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", UPDATE_AT, str(start), mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_apt_updates_started_in_four_processes_at_once_all_succeed(apt_root: None) -> None:
    start = time.time() + 3.0  # every process imported and waiting before the first apt-get starts
    procs = [_update_at(start, "force") for _ in range(4)]
    results = [(p.wait(timeout=600), p.stdout.read() if p.stdout else "") for p in procs]
    failed = [out for code, out in results if code != 0]
    assert failed == [], failed[0][-2000:]
    assert sum("$ apt-get update" in out for _, out in results) == 4


def test_lists_updated_by_another_process_are_not_updated_again(apt_root: None) -> None:
    buildtools.apt_update(lambda _msg: None, force=True)
    proc = _update_at(time.time(), "fresh")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    assert "$ apt-get update" not in out, out


def test_the_apt_lock_is_reentrant_within_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(buildtools.APT_LOCK_ENV, str(tmp_path / "apt.lock"))
    said: list[str] = []
    lock = str(tmp_path / "apt.lock")
    with buildtools.apt_lock(said.append):
        with buildtools.apt_lock(said.append):
            pass
        held = subprocess.run(["flock", "--nonblock", lock, "true"], capture_output=True, check=False)
    assert held.returncode != 0, "the inner exit let the lock go while the outer still held it"
    free = subprocess.run(["flock", "--nonblock", lock, "true"], capture_output=True, check=False)
    assert free.returncode == 0, "the lock stayed held after both exits"
    assert said == []
