"""`python -m bench [--full | --profile tiny|quick|full] [--only NAME,...] [--out bench/results]
[--control-plane-cpus LIST]`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import PROFILES, BenchResult, Context, machine_info, servers
from bench.pinning import CpuListError, control_plane_pinned, parse_cpus, rest_of

# In the order they run (cheap and pure first). Module per benchmark, each with NAME, TITLE and run(ctx).
MODULES = {
    "packing": "bench.packing",
    "replay": "bench.replay",
    "ledger": "bench.ledger_ceiling",
    "latency": "bench.extender_latency",
    "footprint": "bench.footprint",
    "bind": "bench.bind_pipeline",
    "overhead": "bench.scheduler_overhead",
    "scale": "bench.scale",
    "request_size": "bench.request_size",
    "catchup": "bench.accounting_catchup",
    "annotations": "bench.annotations",
    "dra": "bench.dra_paths",
    "realnode": "bench.realnode",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="gpushare benchmarks, each beside a baseline measured in the same run (docs/benchmarks.md).",
    )
    p.add_argument("--full", action="store_true", help="the large sizes (same as --profile full)")
    p.add_argument("--profile", choices=PROFILES, default=None, help="tiny (smoke test), quick (default) or full")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(MODULES)}")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="where to write JSON (bench/results)")
    p.add_argument("--database-url", default=None, help="PostgreSQL server (default: the machine's, else embedded)")
    p.add_argument("--nats-url", default=None, help="NATS server (default: the machine's, else embedded)")
    p.add_argument(
        "--peer-extender",
        metavar="PATH",
        default=None,
        help="the seed's extender (gpushare-scheduler-extender) as shipped, for benchmark 1 (docs/benchmarks.md says "
        "how to build it); without it: 'peer not available'",
    )
    p.add_argument(
        "--peer-extender-raised",
        metavar="PATH",
        default=None,
        help="the seed's extender built with its client's rate limit raised (QPS/burst 1,000), for benchmark 1",
    )
    p.add_argument(
        "--control-plane-cpus",
        metavar="LIST",
        default=None,
        help="run kube-apiserver, etcd, kube-scheduler and kube-controller-manager on these CPUs (taskset's list: "
        "0, 0,2, 0-1) and everything else (gpushare, PostgreSQL, NATS, node agents, kubelet stand-ins, this "
        "process) on the others, as on separate machines; default: all share every CPU",
    )
    args = p.parse_args(argv)
    args.profile = args.profile or ("full" if args.full else "quick")
    args.pinned = None
    if args.control_plane_cpus is not None:
        try:
            args.pinned = parse_cpus(args.control_plane_cpus, os.sched_getaffinity(0))
        except CpuListError as exc:
            p.error(f"--control-plane-cpus: {exc}")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    args.names = names
    return args


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(results: list[BenchResult]) -> str:
    """A plain-text table: one row per metric, targets marked."""
    lines = []
    for r in results:
        lines.append(f"\n== {r.title}  [{r.status}, {r.duration_s:.1f}s]")
        targets = {t.metric: t for t in r.targets}
        for key, value in r.metrics.items():
            mark = ""
            if key in targets:
                t = targets[key]
                verdict = {True: "MET", False: "MISSED", None: "n/a"}[t.met]
                mark = f"   target {t.op} {_fmt(t.value)}: {verdict}"
            lines.append(f"   {key:<40} {_fmt(value):>14}{mark}")
        for note in r.notes:
            lines.append(f"   - {note}")
    return "\n".join(lines)


async def run_one(name: str, ctx: Context) -> BenchResult:
    """Run a benchmark; an exception becomes an `error` result instead of stopping the suite."""
    module = importlib.import_module(MODULES[name])
    t0 = time.perf_counter()
    try:
        result: BenchResult = await module.run(ctx)
    except Exception as exc:
        result = BenchResult(name, getattr(module, "TITLE", name), ctx.profile, status="error")
        result.notes.append(f"{type(exc).__name__}: {exc}")
        result.notes.append(traceback.format_exc(limit=3).strip().splitlines()[-1])
        logging.getLogger("bench").exception("benchmark %s failed", name)
    result.duration_s = round(time.perf_counter() - t0, 2)
    return result.finish()


@contextlib.contextmanager
def cancelled_by_sigterm() -> Iterator[None]:
    """SIGTERM cancels the running benchmarks, so every server and stack they started is stopped on the way out
    (by default it would end this process at once and leave them running, and their load in later runs)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    try:
        if task is None:
            raise RuntimeError("no task to cancel")
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def run_all(args: argparse.Namespace, work_dir: Path) -> list[BenchResult]:
    """Run the selected benchmarks one after the other."""
    with cancelled_by_sigterm(), servers(work_dir) as (db_url, nats_url):
        ctx = Context(args.profile, args.database_url or db_url, args.nats_url or nats_url, work_dir)
        ctx.peer_extenders = {
            v: p for v, p in (("as_shipped", args.peer_extender), ("raised", args.peer_extender_raised)) if p
        }
        results = []
        async with ctx.resources, control_plane_pinned(args.pinned):
            for name in args.names:
                print(f"running {name} ({args.profile}) ...", file=sys.stderr, flush=True)
                results.append(await run_one(name, ctx))
        return results


@contextlib.contextmanager
def quieter(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Raise the named loggers to `level` for the block, then give them back their levels."""
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, before, strict=True):
            lg.setLevel(old)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write `<out>/<profile>-<time>.json` and `<out>/latest.json`; 1 if one errored."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    machine = machine_info()
    if args.pinned:  # before any server, thread or process starts: they all inherit the rest of the CPUs
        os.sched_setaffinity(0, rest_of(args.pinned))
        machine["control_plane_cpus"] = sorted(args.pinned)
        machine["other_cpus"] = sorted(os.sched_getaffinity(0))
    # reconnect chatter when closing, kubelet stand-ins refusing benchmark pods: quiet while the benchmarks run
    # (and only then: `main` is also called in-process, by the benchmark smoke test)
    with quieter("shared.events.bus", "devstack.stack"), tempfile.TemporaryDirectory(prefix="gpushare-bench-") as tmp:
        try:
            results = asyncio.run(run_all(args, Path(tmp)))
        except asyncio.CancelledError:
            print("stopped by SIGTERM; the servers and stacks the benchmarks started are stopped", file=sys.stderr)
            return 128 + signal.SIGTERM
    machine["load_average_after"] = machine_info()["load_average"]
    print(
        f"machine: {machine['cpu_model']}, {machine['nproc']} CPUs, {machine['memory_gib']} GiB, "
        f"load {machine['load_average']} -> {machine['load_average_after']}"
        + (
            f"; control plane on CPU(s) {machine['control_plane_cpus']}, the rest on {machine['other_cpus']}"
            if args.pinned
            else ""
        )
    )
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"profile": args.profile, "machine": machine, "results": [r.to_json() for r in results]}
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = args.out / f"{args.profile}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=2, default=str))
    (args.out / "latest.json").write_text(json.dumps(doc, indent=2, default=str))
    print(f"\nresults: {path}")
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
