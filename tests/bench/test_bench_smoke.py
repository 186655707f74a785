"""The benchmark harness at a tiny size: it runs, writes its JSON, and the JSON has the expected shape."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bench.__main__ import main, table
from bench.common import MACHINE_DATABASE_URL, MACHINE_NATS_URL, BenchResult, Context, Target, percentile, reachable
from bench.packing import workload

FAST = ("packing", "replay", "ledger")


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == 99.0


def test_targets_are_judged_from_metrics() -> None:
    r = BenchResult("x", "X", "tiny", metrics={"a": 5.0, "b": 1.0})
    r.targets = [Target("a", ">=", 4.0), Target("b", "<=", 0.5), Target("missing", ">", 0)]
    r.finish()
    assert [t.met for t in r.targets] == [True, False, None]
    assert "MISSED" in table([r]) and "MET" in table([r])


def test_packing_workload_is_seeded() -> None:
    assert workload(7, 50) == workload(7, 50)
    assert workload(7, 50) != workload(8, 50)


@pytest.mark.slow
def test_quick_profile_of_fast_benchmarks_writes_expected_json(
    tmp_path: Path, pg_server_url: str, nats_url: str
) -> None:
    quieted = [logging.getLogger(n) for n in ("shared.events.bus", "devstack.stack")]
    levels = [lg.level for lg in quieted]
    code = main(
        [
            "--profile",
            "tiny",
            "--only",
            ",".join(FAST),
            "--out",
            str(tmp_path),
            "--database-url",
            pg_server_url,
            "--nats-url",
            nats_url,
        ]
    )
    assert code == 0
    # the benchmarks quiet two loggers while they run, and give them back (a later test's logs depend on it)
    assert [lg.level for lg in quieted] == levels
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["profile"] == "tiny"
    assert doc["machine"]["nproc"] >= 1 and doc["machine"]["cpu_model"] is not None
    by_name = {r["name"]: r for r in doc["results"]}
    assert set(by_name) == set(FAST)
    for r in by_name.values():
        assert r["status"] == "ok", r["notes"]
        assert {"name", "title", "profile", "status", "metrics", "targets", "params", "notes", "duration_s"} <= set(r)
        assert all(isinstance(v, int | float) for v in r["metrics"].values())
    packing = by_name["packing"]["metrics"]
    assert 0 < packing["baseline_utilisation_pct"] <= 100 and 0 < packing["project_utilisation_pct"] <= 100
    assert {"project_free_gpus", "baseline_free_gpus", "utilisation_gain_pct_points"} <= set(packing)
    replay = by_name["replay"]["metrics"]
    published = by_name["replay"]["params"]["events"]
    # usage samples go to the samples stream, which a rebuild does not read; every ledger event is read
    assert 0 < replay["sample_events"] < published
    assert replay["events_read"] == published - replay["sample_events"] and replay["skipped"] == 0
    assert replay["events_per_s"] > 0
    assert [t["metric"] for t in by_name["replay"]["targets"]] == ["events_per_s"]
    ledger = by_name["ledger"]["metrics"]
    assert ledger["reservations_per_s"] > 0 and ledger["update_per_s"] > 0
    assert ledger["ratio_reservations_vs_update"] == pytest.approx(
        ledger["reservations_per_s"] / ledger["update_per_s"], rel=0.01
    )
    assert {"reserve_p50_ms", "reserve_p99_ms", "update_p50_ms", "update_p99_ms"} <= set(ledger)


@pytest.mark.parametrize("profile", ["tiny", "quick", "full"])
def test_scheduler_overhead_nodes_hold_both_phases_of_a_round(profile: str, tmp_path: Path) -> None:
    from bench.scheduler_overhead import max_pods_per_node, sizes

    pods, nodes, _ = sizes(Context(profile, "postgresql://unused", "nats://unused", tmp_path))
    assert nodes * max_pods_per_node(pods, nodes) >= 2 * pods


def _children(pid: int) -> set[int]:
    """The process's children now (from /proc)."""
    found: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.skipif(
    reachable(MACHINE_DATABASE_URL) or reachable(MACHINE_NATS_URL),
    reason="this machine runs its own PostgreSQL or NATS, which the benchmarks use instead of starting theirs",
)
def test_sigterm_stops_the_servers_the_benchmarks_started(tmp_path: Path) -> None:
    """A benchmark run ended with SIGTERM stops the embedded PostgreSQL and NATS it started, instead of leaving
    them running (and loading the machine) after it is gone."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {
        **os.environ,
        # servers nobody listens on: the run starts its own embedded ones
        "GPUSHARE_BENCH_DATABASE_URL": "",
        "GPUSHARE_BENCH_NATS_URL": "",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "--profile", "tiny", "--only", "replay", "--out", str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: set[int] = set()
    work_dir = ""
    try:
        deadline = time.monotonic() + 60
        # NATS starts after PostgreSQL: once it runs, both do
        while not any("nats-server" in _cmdline(c) for c in children) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before its servers were up"
            children |= _children(proc.pid)
            time.sleep(0.1)
        nats = next((c for c in children if "nats-server" in _cmdline(c)), None)
        assert nats is not None, "the run did not start its servers"
        # PostgreSQL runs detached (pg_ctl), so it is found by the run's work folder in its command line
        work_dir = _cmdline(nats).split("/nats/")[0].split()[-1]
        assert "gpushare-bench-" in work_dir, _cmdline(nats)
        children |= {int(d.name) for d in Path("/proc").glob("[0-9]*") if work_dir in _cmdline(int(d.name))}
        assert any("postgres" in _cmdline(c) for c in children), "no PostgreSQL of the run's own was found"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
        assert "stopped by SIGTERM" in stderr
        deadline = time.monotonic() + 20
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)], "servers left running after the run ended"
    finally:
        if proc.poll() is None:
            proc.kill()
        if work_dir:  # whatever of the run is still up (the run's own cleanup failed): gone before the next test
            children |= {int(d.name) for d in Path("/proc").glob("[0-9]*") if work_dir in _cmdline(int(d.name))}
        for child in children:
            if _alive(child):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
