"""Pinning real processes to CPUs and giving their affinity back; the product's CPU per pod."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bench.affinity import deployment_plan, pinned, threads, usable_cpus
from bench.cpu import CENTRAL_GROUPS, CONTROL_PLANE_GROUPS, PRODUCT_GROUPS, group_of, product_ms_per_pod, tree

# three idle threads; on a line from stdin one more thread and a child process (as a postmaster forks a backend)
CHILD = """
import subprocess, sys, threading, time
idle = lambda: time.sleep(120)
for _ in range(3):
    threading.Thread(target=idle, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=idle, daemon=True).start()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *sys.argv[1:]])
print("started", flush=True)
sys.stdin.readline()
grandchild.kill()
grandchild.wait()
"""

# named as a service is (`... services.cli <name>`, the grandchild too), so that no other process of the test
# session (a multiprocessing resource tracker left by an earlier test, say) falls into the group the plan pins
ARGV = [sys.executable, "-c", CHILD, "services.cli", "affinity-test-child"]
GROUP = group_of(" ".join(ARGV), 0)  # a plan may name any group
needs_two_cpus = pytest.mark.skipif(len(usable_cpus()) < 2, reason="pinning is only visible with two CPUs or more")


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    """A Python process with four threads, waiting for its cue."""
    proc = subprocess.Popen(ARGV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    try:
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the child kills its grandchild and exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def affinities(pid: int) -> dict[int, set[int]]:
    """Each thread of the process and the CPUs it may run on."""
    return {tid: os.sched_getaffinity(tid) for tid in threads(pid)}


def cue(proc: subprocess.Popen[str], expect: str) -> None:
    """Tell the child to go on; wait for its answer."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == expect


@needs_two_cpus
def test_every_thread_pinned_then_given_back(child: subprocess.Popen[str]) -> None:
    cpus = usable_cpus()
    before = affinities(child.pid)
    assert len(before) >= 4 and all(a == set(cpus) for a in before.values())
    me = os.sched_getaffinity(0)

    with pinned({GROUP: {cpus[0]}}, [os.getpid()]) as pinning:
        assert affinities(child.pid) == {tid: {cpus[0]} for tid in before}
        assert pinning.pinned() == {GROUP: (1, len(before))}
        assert pinning.left[os.getpid()] == "bench"  # the load generator is left alone
        assert os.sched_getaffinity(0) == me
        cue(child, "started")  # a thread and a process started from pinned threads inherit their CPU
        (grandchild,) = [p.pid for p in tree([child.pid]) if p.pid != child.pid]
        assert os.sched_getaffinity(grandchild) == {cpus[0]}
        placement = pinning.placement()
        assert (placement.threads, placement.new, placement.off) == (len(before) + 2, 2, 0)

    assert all(a == set(cpus) for a in affinities(child.pid).values())
    assert len(affinities(child.pid)) == len(before) + 1
    assert os.sched_getaffinity(grandchild) == set(cpus)
    cue(child, "")  # let it go


@needs_two_cpus
def test_a_process_that_exits_while_pinned_is_skipped(child: subprocess.Popen[str]) -> None:
    cpus = usable_cpus()
    with pinned({GROUP: {cpus[1]}}, [child.pid]) as pinning:
        assert pinning.pinned()[GROUP][1] >= 4
        child.kill()
        child.wait()
    assert pinning.restore() == 0


def test_deployment_plan_puts_the_control_plane_and_the_add_on_on_two_cpus() -> None:
    assert deployment_plan([3]) is None
    plan = deployment_plan([2, 5, 7])
    assert plan is not None and set(plan) == set(CONTROL_PLANE_GROUPS) | set(PRODUCT_GROUPS)
    assert {g for g, c in plan.items() if c == {2}} == set(CONTROL_PLANE_GROUPS)
    assert {g for g, c in plan.items() if c == {5}} == set(PRODUCT_GROUPS)


def test_product_cpu_is_the_sum_of_the_gpushare_groups() -> None:
    metrics = {
        "gpu_cpu_ms_per_pod_extender": 4.0,
        "gpu_cpu_ms_per_pod_binder": 3.0,
        "gpu_cpu_ms_per_pod_accounting": 1.5,
        "gpu_cpu_ms_per_pod_node_agent": 0.25,
        "gpu_cpu_ms_per_pod_postgres": 2.0,
        "gpu_cpu_ms_per_pod_nats_server": 0.75,
        "gpu_cpu_ms_per_pod_kube_apiserver": 9.0,  # the control plane's and the client's are not the product's
        "gpu_cpu_ms_per_pod_bench": 5.0,
        "gpu_cpu_ms_per_pod_total": 25.5,
        "pinned_gpu_cpu_ms_per_pod_extender": 100.0,  # another variant's
    }
    assert product_ms_per_pod(metrics, "gpu") == 11.5
    assert product_ms_per_pod(metrics, "pinned_gpu") == 100.0
    assert product_ms_per_pod({}, "gpu") == 0.0
    assert product_ms_per_pod(metrics, "gpu", CENTRAL_GROUPS) == 11.25  # the node agents run on the GPU nodes
