"""`python -m bench --control-plane-cpus 0`: the control plane on CPUs of its own, everything else on the others.

On a machine of a few cores, gpushare's services and the Kubernetes control plane take CPU from each other, so a
path that costs gpushare more also slows the control plane it is compared with. In production they run on
different machines (kube-apiserver, etcd, kube-scheduler and kube-controller-manager on control-plane nodes). With
this option the benchmark plays that shape on one machine: the benchmark process, and with it every process it
starts (gpushare's services, PostgreSQL, NATS, the node agents, the kubelet stand-ins), runs on the CPUs not named;
every thread of each control-plane process is moved to the CPUs named as soon as it is seen (a thread a pinned
thread starts inherits its CPUs, so the watch only catches the first moments of each process).

Benchmark 1 pins its own `pinned_*` phase for its duration (`bench.affinity`, control plane and gpushare's add-on
on a CPU each); under this option it has the other CPUs only, and skips that phase where they are fewer than two.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from bench.affinity import Pinning
from bench.cpu import CONTROL_PLANE_GROUPS

WATCH_S = 1.0  # how often new control-plane processes and threads are looked for (before the phases measured)


class CpuListError(ValueError):
    """A CPU list that cannot be used (the message says why)."""


def parse_cpus(text: str, available: set[int]) -> set[int]:
    """A CPU list as taskset writes it ("0", "0,2", "0-1") checked against the CPUs this process may use; at least
    one of them must stay for everything else (pure)."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise CpuListError(f"{text!r} is not a CPU list (write it as taskset does: 0 or 0,2 or 0-1)") from None
        if low < 0 or high < low:
            raise CpuListError(f"{part!r} in {text!r} is not a CPU range")
        cpus.update(range(low, high + 1))
    missing = cpus - available
    if missing:
        raise CpuListError(f"CPU(s) {sorted(missing)} are not available here (available: {sorted(available)})")
    if not available - cpus:
        raise CpuListError(
            f"the control plane would take every CPU ({sorted(available)}): leave at least one for the rest"
        )
    return cpus


def rest_of(cpus: set[int]) -> set[int]:
    """The CPUs the benchmark and gpushare keep: this process's, less the control plane's."""
    return os.sched_getaffinity(0) - cpus


@contextlib.asynccontextmanager
async def control_plane_pinned(cpus: set[int] | None) -> AsyncIterator[None]:
    """While the block runs, keep this process's control-plane descendants on `cpus` (None: do nothing)."""
    if not cpus:
        yield
        return
    stop = asyncio.Event()
    pinning = Pinning({group: cpus for group in CONTROL_PLANE_GROUPS}, [os.getpid()])

    async def watch() -> None:
        while not stop.is_set():
            pinning.apply()  # benchmark 1's pinning, again for the control planes started since the last pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_S)

    task = asyncio.create_task(watch(), name="control-plane-pinning")
    try:
        yield
    finally:
        stop.set()
        await task
