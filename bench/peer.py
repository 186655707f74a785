"""The seed's own extender beside gpushare: Aliyun's gpushare-scheduler-extender (Go, commit c0b61411), run on the
same control plane, nodes and pods as benchmark 1, with a kube-scheduler of its own.

Nothing of it is in the repository: `--peer-extender PATH` names its binary as built from its source (as shipped)
and `--peer-extender-raised PATH` a build whose API client allows 1,000 requests/s (the source builds its client
from the kubeconfig alone, so client-go's defaults hold it to 5 requests/s with a burst of 10; it has no flag or
environment variable for them: the raised build patches its `initKubeClient`). docs/benchmarks.md says how both
were built. Without a path the variant is reported "peer not available".

It is configured as its own documentation configures it: a kube-scheduler profile `gpushare-peer` (its pods carry
`schedulerName: gpushare-peer`) whose extender filters and binds (no prioritize), manages `aliyun.com/gpu-mem` and
lets kube-scheduler count it (`ignoredByScheduler: false`), `nodeCacheCapable: true`. It reads each node's
`aliyun.com/gpu-mem` and `aliyun.com/gpu-count` capacity (the simulated nodes advertise both). Its bind patches the
pod's annotations, then writes the Binding. Its device plugin is not run here: its pods stay bound and no kubelet
admits them, so its figures are scheduling only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import cpu
from devstack.cluster.controlplane import ExtenderConfig, scheduler_config
from devstack.embedded import free_port
from devstack.monitoring.server import http_ok

SCHEDULER_NAME = "gpushare-peer"
PEER_GROUP = "peer-extender"
PEER_SCHEDULER_GROUP = "peer-kube-scheduler"
PEER_SCHEDULER_CONFIG = "gpushare-peer-scheduler.json"  # names its kube-scheduler in the CPU table (`bench.cpu`)
AS_SHIPPED = "as_shipped"
RAISED = "raised"
VARIANTS = {
    AS_SHIPPED: "as shipped: client-go's default client rate limit, 5 requests/s, burst 10",
    RAISED: "rate limit raised: its client built with QPS 1,000 / burst 1,000 (a local patch of initKubeClient)",
}


@dataclass
class PeerProcesses:
    """The peer's extender and kube-scheduler while one phase runs."""

    extender: subprocess.Popen[bytes]
    scheduler: subprocess.Popen[bytes]
    logs: list[Path]

    def stop(self) -> None:
        """SIGTERM both, then SIGKILL what is left after 10 s."""
        for proc in (self.scheduler, self.extender):
            if proc.poll() is None:
                proc.terminate()
        for proc in (self.scheduler, self.extender):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def available(path: str | None) -> str:
    """'' when the binary at `path` can run, else why not ("peer not available: ...")."""
    if not path:
        return "peer not available: no binary given"
    if not os.access(path, os.X_OK):
        return f"peer not available: {path} is not an executable file"
    return ""


def extender_config(port: int) -> ExtenderConfig:
    """kube-scheduler's entry for the peer as its repository configures it (config/scheduler-policy-config.json):
    filter and bind only, managing aliyun.com/gpu-mem, which kube-scheduler counts too (ignoredByScheduler false)."""
    return ExtenderConfig(
        url_prefix=f"http://127.0.0.1:{port}/gpushare-scheduler",
        prioritize_verb=None,
        preempt_verb=None,
        managed_resources=("aliyun.com/gpu-mem",),
        ignored_by_scheduler=(),
    )


async def start(stack: Any, binary: str, work_dir: Path, *, scheduler_qps: int) -> PeerProcesses:
    """The peer's extender (its port in `PORT`, the stack's admin kubeconfig in `KUBECONFIG`), then its
    kube-scheduler; both ready. `scheduler_qps`: the peer's kube-scheduler's own client (as gpushare's)."""
    await asyncio.to_thread(work_dir.mkdir, parents=True, exist_ok=True)
    cpu.NAMED_PROGRAMS[binary] = PEER_GROUP
    cpu.NAMED_PROGRAMS[PEER_SCHEDULER_CONFIG] = PEER_SCHEDULER_GROUP
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(stack.kubeconfig), "PORT": str(port), "LOG_LEVEL": "warn"}
    ext_log = work_dir / "peer-extender.log"
    extender = await asyncio.to_thread(_spawn, [binary], ext_log, work_dir, env)
    await _until(lambda: http_ok(f"http://127.0.0.1:{port}/version"), extender, ext_log, "its /version")
    control_plane = stack.control_plane
    ext = extender_config(port)
    secure = free_port()
    config = scheduler_config(
        control_plane.kubeconfig_path,
        ext,
        SCHEDULER_NAME,
        release=control_plane.release,
        extra={
            "podInitialBackoffSeconds": 1,
            "podMaxBackoffSeconds": 2,
            "clientConnection": {"qps": scheduler_qps, "burst": scheduler_qps},
        },
    )
    config_path = work_dir / PEER_SCHEDULER_CONFIG
    config_path.write_text(json.dumps(config, indent=2))
    sched_log = work_dir / "peer-kube-scheduler.log"
    args = [
        str(stack.config.control_plane_paths.kube_scheduler),
        f"--config={config_path}",
        "--bind-address=127.0.0.1",
        f"--secure-port={secure}",
        "--v=1",
    ]
    scheduler = await asyncio.to_thread(_spawn, args, sched_log, work_dir, None)
    procs = PeerProcesses(extender, scheduler, [ext_log, sched_log])
    try:
        await _until(lambda: http_ok(f"https://127.0.0.1:{secure}/healthz"), scheduler, sched_log, "healthy")
    except BaseException:
        procs.stop()
        raise
    return procs


def pod_body(name: str, gib: int) -> dict[str, Any]:
    """A pod for the peer: its scheduler, `aliyun.com/gpu-mem` in GiB (as gpushare's)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "containers": [
                {"name": "main", "image": "busybox", "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)}}}
            ],
            "terminationGracePeriodSeconds": 0,
        },
    }


def is_peer_pod(pod: dict[str, Any]) -> bool:
    """A pod the peer schedules (no kubelet here admits it: its device plugin is not run)."""
    return (pod.get("spec") or {}).get("schedulerName") == SCHEDULER_NAME


async def _until(ready: Any, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(ready):
        if proc.poll() is not None:
            raise RuntimeError(f"the peer's {log.stem} exited with {proc.returncode}: {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the peer's {log.stem} not {what} after {timeout_s:.0f} s: {_tail(log)}")
        await asyncio.sleep(0.2)


def _spawn(args: list[str], log: Path, cwd: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)


def _tail(log: Path, nbytes: int = 1500) -> str:
    try:
        return log.read_bytes()[-nbytes:].decode(errors="replace")
    except OSError:
        return ""
