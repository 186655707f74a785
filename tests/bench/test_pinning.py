"""`python -m bench --control-plane-cpus`: the CPU list it takes, and the control plane's threads moved onto it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bench.__main__ import parse_args
from bench.affinity import threads
from bench.pinning import WATCH_S, CpuListError, control_plane_pinned, parse_cpus


def test_a_cpu_list_is_read_as_taskset_writes_it() -> None:
    assert parse_cpus("0", {0, 1}) == {0}
    assert parse_cpus("0,2", {0, 1, 2, 3}) == {0, 2}
    assert parse_cpus("1-2, 4", {0, 1, 2, 3, 4}) == {1, 2, 4}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("x", "is not a CPU list"),
        ("2-1", "is not a CPU range"),
        ("7", "are not available here"),
        ("0-1", "leave at least one for the rest"),
    ],
)
def test_a_cpu_list_that_cannot_be_used_says_why(text: str, says: str) -> None:
    with pytest.raises(CpuListError, match=says):
        parse_cpus(text, {0, 1})


def test_the_command_line_refuses_a_list_that_leaves_nothing_for_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    with pytest.raises(SystemExit) as exited:
        parse_args(["--only", "packing", "--control-plane-cpus", every])
    assert exited.value.code == 2
    assert "--control-plane-cpus: the control plane would take every CPU" in capsys.readouterr().err
    assert parse_args(["--only", "packing"]).pinned is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
async def test_every_thread_of_a_control_plane_process_is_moved_onto_its_cpus(tmp_path: Path) -> None:
    cpus = {min(os.sched_getaffinity(0))}
    program = tmp_path / "kube-apiserver"  # named as the control plane's program: `bench.cpu.group_of` reads the name
    program.symlink_to("/bin/sleep")
    other = await asyncio.create_subprocess_exec("/bin/sleep", "30")  # not the control plane's: left where it is
    server = await asyncio.create_subprocess_exec(str(program), "30")
    try:
        assert os.sched_getaffinity(server.pid) != cpus
        async with control_plane_pinned(cpus):
            for _ in range(int(10 / WATCH_S)):
                if os.sched_getaffinity(server.pid) == cpus:
                    break
                await asyncio.sleep(0.1)
        assert os.sched_getaffinity(server.pid) == cpus
        assert os.sched_getaffinity(other.pid) == os.sched_getaffinity(0)
        assert all(os.sched_getaffinity(t) == cpus for t in threads(server.pid))  # nothing left to move
    finally:
        for p in (server, other):
            p.kill()
            await p.wait()
