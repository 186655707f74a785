"""Pinning the benchmark's processes to CPU sets, as a deployment places them (Linux, `sched_setaffinity`).

A plan maps groups (as `bench.cpu.group_of` names them) to CPUs. Every thread (`/proc/<pid>/task/<tid>`) of
every process of a planned group in the benchmark's trees (`bench.cpu.benchmark_roots`: this process's
descendants and the PostgreSQL / NATS servers) is pinned; this process, the load generator, never is. Threads
and processes started later inherit the affinity of the thread that starts them (so new PostgreSQL backends
follow the pinned postmaster). `pinned(plan, roots)` gives everything back its affinity afterwards.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.cpu import CONTROL_PLANE_GROUPS, PRODUCT_GROUPS, group_of, tree

PASSES = 5  # threads started by a not-yet-pinned thread while pinning are caught by the next pass


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order (none where affinity cannot be set: not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def deployment_plan(cpus: list[int] | None = None) -> dict[str, set[int]] | None:
    """The control plane on the first usable CPU, gpushare's add-on (its services, PostgreSQL, NATS) on the
    second; None with fewer than two."""
    cpus = usable_cpus() if cpus is None else cpus
    if len(cpus) < 2:
        return None
    return {g: {cpus[0]} for g in CONTROL_PLANE_GROUPS} | {g: {cpus[1]} for g in PRODUCT_GROUPS}


def threads(pid: int) -> list[int]:
    """The thread ids of a process (none once it has exited)."""
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


@dataclass(frozen=True)
class Placement:
    """The planned groups' threads at a moment: how many, how many appeared after pinning, how many are off
    their CPUs."""

    threads: int
    new: int
    off: int


@dataclass
class Pinning:
    """The processes of the planned groups under `roots`, pinned by `apply`, given back by `restore`."""

    plan: Mapping[str, set[int]]
    roots: list[int]
    before: dict[int, set[int]] = field(default_factory=dict)  # thread id -> its affinity before pinning
    process_before: dict[int, set[int]] = field(default_factory=dict)  # pinned process -> its first thread's
    groups: dict[int, str] = field(default_factory=dict)  # pinned process -> its group
    thread_owner: dict[int, int] = field(default_factory=dict)  # pinned thread -> its process
    left: dict[int, str] = field(default_factory=dict)  # processes not in the plan (this one, 'other') -> group
    failed: set[int] = field(default_factory=set)  # threads that could not be pinned (permission)

    def apply(self) -> Pinning:
        """Pin every thread of the planned processes, pass after pass until one finds nothing to do."""
        for _ in range(PASSES):
            changed = 0
            for proc in tree(self.roots):
                group = group_of(proc.command, proc.pid)
                cpus = self.plan.get(group)
                if cpus is None or proc.pid == os.getpid():
                    self.left[proc.pid] = group
                    continue
                self.groups[proc.pid] = group
                changed += sum(self._pin(proc.pid, tid, cpus) for tid in threads(proc.pid))
            if not changed:
                break
        return self

    def _pin(self, pid: int, tid: int, cpus: set[int]) -> bool:
        try:
            now = os.sched_getaffinity(tid)
            self.before.setdefault(tid, now)
            self.process_before.setdefault(pid, now)
            self.thread_owner[tid] = pid
            if now == cpus:
                return False
            os.sched_setaffinity(tid, cpus)
        except PermissionError:
            self.failed.add(tid)
            return False
        except OSError:  # exited meanwhile
            return False
        return True

    def pinned(self) -> dict[str, tuple[int, int]]:
        """Per group: (processes, threads) pinned."""
        procs = Counter(self.groups.values())
        tids = Counter(self.groups[pid] for tid, pid in self.thread_owner.items() if tid not in self.failed)
        return {g: (procs[g], tids[g]) for g in procs}

    def summary(self) -> str:
        """One line: what went where, and what was left alone."""
        parts = [
            f"{g} {p} proc/{t} thr -> CPU {','.join(map(str, sorted(self.plan[g])))}"
            for g, (p, t) in sorted(self.pinned().items())
        ]
        left = Counter(self.left.values())
        parts.append("unpinned: " + ", ".join(f"{g} {n} proc" for g, n in sorted(left.items())))
        if self.failed:
            parts.append(f"{len(self.failed)} threads refused (permission)")
        return "; ".join(parts)

    def placement(self) -> Placement:
        """Where the planned groups' threads are now (those started after `apply` included)."""
        total = new = off = 0
        for proc in tree(self.roots):
            cpus = self.plan.get(group_of(proc.command, proc.pid))
            if cpus is None or proc.pid == os.getpid():
                continue
            for tid in threads(proc.pid):
                with contextlib.suppress(OSError):
                    off += os.sched_getaffinity(tid) != cpus
                    total += 1
                    new += tid not in self.thread_owner
        return Placement(total, new, off)

    def restore(self) -> int:
        """Give every pinned thread its affinity back, and threads and processes started from them since then
        their parent's; returns how many threads were set. Processes that exited are skipped."""
        parents = {p.pid: p.ppid for p in tree(self.roots)}
        done = 0
        for pid in set(parents) | set(self.groups):
            fallback = self._before_of_process(pid, parents)
            if fallback is None:
                continue
            for tid in threads(pid):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, self.before.get(tid, fallback))
                    done += 1
        return done

    def _before_of_process(self, pid: int, parents: dict[int, int]) -> set[int] | None:
        """The affinity a process had before (its main thread's), else its nearest pinned ancestor's."""
        seen: set[int] = set()
        while pid not in seen:
            seen.add(pid)
            if pid in self.process_before:
                return self.before.get(pid, self.process_before[pid])
            if pid not in parents:
                return None
            pid = parents[pid]
        return None


@contextlib.contextmanager
def pinned(plan: Mapping[str, set[int]], roots: list[int]) -> Iterator[Pinning]:
    """`with pinned(plan, roots) as p:` the planned groups run on their CPUs; afterwards as before."""
    pinning = Pinning(plan, roots)
    try:
        yield pinning.apply()
    finally:
        pinning.restore()
