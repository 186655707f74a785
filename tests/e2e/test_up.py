"""`gpushare up` as users run it: the scheduler simulator, and the whole stack on the local control plane."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from devstack.cluster import Paths
from tests import system_tools
from tests.conftest import create_database, drop_database

pytestmark = pytest.mark.e2e


async def _up(tmp_path: Path, database_url: str, nats_url: str, *args: str, limit_s: float = 240) -> tuple[int, str]:
    tag = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",) and not k.startswith("GPUSHARE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--data-dir",
        str(tmp_path / "data"),
        "--database-url",
        database_url,
        "--nats-url",
        nats_url,
        "--stream-name",
        f"GPUSHARE_U{tag}",
        "--subject-prefix",
        f"gsu{tag}",
        "--extender-port",
        "0",
        "--binder-port",
        "0",
        "--accounting-port",
        "0",
        "--exit-after-demo",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), limit_s)
    except TimeoutError:
        proc.terminate()
        out, _ = await proc.communicate()
        raise AssertionError(f"gpushare up did not finish in {limit_s}s:\n{out.decode()[-5000:]}") from None
    return proc.returncode or 0, out.decode(errors="replace")


@pytest.fixture
def up_database(pg_server_url: str):
    name = f"gpushare_up_{uuid.uuid4().hex[:8]}"
    yield create_database(pg_server_url, name)
    drop_database(pg_server_url, name)


def _placements(out: str) -> dict[str, str]:
    return dict(re.findall(r"^\s+((?:bert-training|resnet-inference)-\S+)\s+-> (\S+)$", out, re.M))


async def test_up_help() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "up", "--help", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    for flag in ("--data-dir", "--nodes", "--gpus", "--no-demo", "--simulate", "--database-url"):
        assert flag in out.decode()


async def test_up_simulator_places_the_demo(tmp_path: Path, up_database: str, nats_url: str) -> None:
    code, out = await _up(tmp_path, up_database, nats_url, "--simulate", "--nodes", "2", limit_s=120)
    assert code == 0, out[-5000:]
    placed = _placements(out)
    assert len(placed) == 6, out[-5000:]
    assert set(placed.values()) <= {"gpu-node-1", "gpu-node-2"}, placed
    assert "scheduler simulator" in out
    assert "Dashboard:  http://127.0.0.1:" in out
    assert "16/32" in out, out[-3000:]  # inspect: 2x4 + 4x2 GiB of 2x16 GiB
    assert_plain(out, tmp_path)


async def test_up_places_the_guides_half_gigabyte_pods_in_mib(tmp_path: Path, up_database: str, nats_url: str) -> None:
    code, out = await _up(
        tmp_path, up_database, nats_url, "--simulate", "--memory-unit", "MiB", "--dev-pods", "2", limit_s=120
    )
    assert code == 0, out[-5000:]
    notebooks = re.findall(r"^\s+(dev-notebook-\S+)\s+-> (gpu-node-\d)$", out, re.M)
    assert len(notebooks) == 2 and len(_placements(out)) == 6, out[-5000:]
    # inspect counts MiB: 2 x 4096 + 4 x 2048 + 2 x 512 of 2 x 16384
    assert "17408/32768" in out and "GPU Memory(MiB)" in out, out[-3000:]


def assert_plain(out: str, tmp_path: Path) -> None:
    """People's lines on the terminal; the JSON logs in the log file (before, they interleaved with the output)."""
    machine = [line for line in out.splitlines() if line.lstrip().startswith("{")]
    assert machine == [], machine[:5]
    log = tmp_path / "data" / "logs" / "gpushare-up.log"
    assert '"msg": "started extender"' in log.read_text()


@pytest.fixture(scope="module")
def monitoring_binaries() -> tuple[Path, Path]:
    """Prometheus and prometheus-adapter, ready before `--monitoring`'s timed run (a new machine builds the adapter
    for minutes)."""
    return system_tools.monitoring_binaries()


async def test_up_runs_the_demo_on_the_local_control_plane(
    tmp_path: Path, up_database: str, nats_url: str, control_plane_binaries: Paths, monitoring_binaries: object
) -> None:
    code, out = await _up(
        tmp_path,
        up_database,
        nats_url,
        *("--nodes", "2", "--nodes-kind", "stand-in", "--bind-timeout", "20", "--monitoring"),
        limit_s=240,
    )
    assert code == 0, out[-5000:]
    placed = _placements(out)
    assert len(placed) == 6 and "Pending" not in placed.values(), out[-5000:]
    assert "export KUBECONFIG=" in out
    assert "Nodes:      kubelet stand-ins\n" in out, out[-3000:]
    assert "16/32" in out, out[-3000:]
    assert "==> stopped" in out
    # the demo's simulated usage went through the node agents, the stream and accounting into right-sizing
    assert "Right-sizing from observed usage (simulated usage, rules in" in out, out[-5000:]
    # named by their Deployments (accounting read each ReplicaSet's owner), not by a ReplicaSet's hash
    advice = dict(re.findall(r"^\s+(bert-training|resnet-inference)\s+\d pod\(s\): (.*)$", out, re.M))
    assert set(advice) == {"bert-training", "resnet-inference"}, out[-5000:]
    assert any("peaks at 922 MiB: 100 % more pods per GPU at 1 GiB" in a for a in advice.values()), out[-5000:]
    assert any("peaks at 4.4 GiB: needs 5 GiB" in a for a in advice.values()), out[-5000:]
    assert re.search(r"need 14 GiB instead of 16 GiB: frees 2 GiB", out), out[-5000:]
    # --monitoring: Prometheus and prometheus-adapter (custom and external metrics) beside it, and how to try the HPA
    assert re.search(r"^Prometheus: http://127\.0\.0\.1:\d+/graph", out, re.M), out[-5000:]
    assert "HPA metric: kubectl get --raw '/apis/custom.metrics.k8s.io/v1beta2/namespaces/gpushare-demo/pods/*/" in out
    assert "Monitoring:" not in out, out[-5000:]
    assert "/apis/external.metrics.k8s.io/v1beta1/namespaces/gpushare-demo/aliyun_gpu_mem_usage" in out
    # k8s/base's admission policies are in force on the local cluster, as in a cluster with gpushare
    assert (
        "admission policies of k8s/base enforced: "
        "gpushare-device-env, gpushare-device-env-workloads, gpushare-annotations" in out
    )
    assert_plain(out, tmp_path)


def _descendants(pid: int) -> dict[int, str]:
    """Every living descendant of `pid` (pid -> its start time in clock ticks, so a reused pid is not mistaken)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        starts[int(entry.name)] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = starts[child]
        todo.extend(children.get(child, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _still_running(procs: dict[int, str]) -> list[str]:
    left = []
    for pid, start in procs.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            left.append(f"{pid}: {cmdline[:160]}")
    return left


async def test_up_stops_everything_when_its_terminal_pipe_is_gone(
    tmp_path: Path, up_database: str, nats_url: str
) -> None:
    """`make run 2>&1 | tee run.log`, then Ctrl-C: the terminal's SIGINT ends `tee` as well, so every line printed
    while stopping goes to a closed pipe. The stack must stop all it started anyway (before, the first such print
    raised BrokenPipeError and the services were left running)."""
    import signal

    tag = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",) and not k.startswith("GPUSHARE_")}
    read_end, write_end = os.pipe()
    argv = [sys.executable, "-m", "services.cli", "up", "--simulate", "--nodes", "2", "--no-demo"]
    argv += ["--data-dir", str(tmp_path / "data"), "--database-url", up_database, "--nats-url", nats_url]
    argv += ["--stream-name", f"GPUSHARE_P{tag}", "--subject-prefix", f"gsp{tag}"]
    argv += ["--extender-port", "0", "--binder-port", "0", "--accounting-port", "0"]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=write_end, stderr=write_end, env=env)
    os.close(write_end)
    reader = os.fdopen(read_end, "rb", buffering=0)
    seen = b""
    try:
        deadline = asyncio.get_running_loop().time() + 120
        while b"Press Ctrl-C to stop" not in seen:
            assert asyncio.get_running_loop().time() < deadline, seen.decode(errors="replace")[-3000:]
            chunk = await asyncio.to_thread(reader.read, 65536)
            assert chunk, f"gpushare up ended early:\n{seen.decode(errors='replace')[-3000:]}"
            seen += chunk
        started = _descendants(proc.pid)
        names = " ".join(_cmdline(pid) for pid in started)
        assert "\0extender\0" in names and "\0accounting\0" in names, names
        reader.close()  # tee is gone
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    left = _still_running(started)
    assert left == [], "left running after Ctrl-C with the terminal pipe closed:\n" + "\n".join(left)
    log_tail = (tmp_path / "data" / "logs" / "gpushare-up.log").read_text()[-3000:]
    assert code == 0, f"gpushare up exited {code}; its log:\n{log_tail}"
