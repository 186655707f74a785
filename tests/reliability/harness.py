"""Reusable process helpers for reliability and security tests: start `gpushare <service>` subprocesses,
wait for them, kill -9 them, restart them, read their logs and memory."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devstack.embedded import free_port

REPO = Path(__file__).resolve().parents[2]


def gpushare_command(*args: str) -> list[str]:
    """The argv that runs `gpushare ARGS` with this interpreter."""
    return [sys.executable, "-m", "services.cli", *args]


def run_gpushare(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess:
    """Run a short gpushare command to completion, capturing its output."""
    return subprocess.run(
        gpushare_command(*args),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def burst_stack_config(  # type: ignore[no-untyped-def]
    data_dir: Path, binaries: Any, *, tag: str, letter: str, nats_url: str, log: Any, **extra: Any
):
    """The reliability tier's `gpushare up` stack: 2 nodes x 2 Tesla-T4 16 GiB, ports chosen freely, a 15 s bind
    timeout, kube-scheduler retrying a pod after 1-2 s, a stream and subject prefix of its own (`letter` tells
    the scenarios' apart); `extra` for the rest (`database_url`, `service_roles`, ...)."""
    from devstack.stack.stack import StackConfig

    return StackConfig(
        data_dir=data_dir,
        nodes=2,
        gpus="2x16GiB:Tesla-T4",
        node_prefix=f"{letter.lower()}{letter.lower()}-{tag[:4]}",
        extender_port=0,
        binder_port=0,
        accounting_port=0,
        bind_timeout=15.0,
        nats_url=nats_url,
        stream_name=f"GPUSHARE_{letter.upper()}{tag}",
        subject_prefix=f"gs{letter.lower()}{tag}",
        log_level="INFO",
        scheduler_extra={"podInitialBackoffSeconds": 1, "podMaxBackoffSeconds": 2},
        control_plane_paths=binaries,
        progress=lambda m: log.info(m),
        **extra,
    )


def require_complete(stack: Any) -> None:
    """Skip (fail under CI: CI must not skip) when the stack did not get the local control plane and every service."""
    from devstack.stack.stack import MODE_LOCAL
    from tests import system_tools

    if stack.mode != MODE_LOCAL or not {"extender", "binder", "accounting"} <= set(stack.processes):
        system_tools.unavailable(f"stack incomplete: mode={stack.mode} ({stack.mode_reason}), missing={stack.missing}")


async def ledger_rebuild(stack: Any, stream: str | None = None) -> subprocess.CompletedProcess:
    """`gpushare ledger rebuild` against a stack: compares its live ledger with a replay of `stream` (default:
    the stack's); exit 1 lists the differences."""
    return await asyncio.to_thread(
        run_gpushare,
        "ledger",
        "rebuild",
        "--database-url",
        stack.database_url,
        "--nats-url",
        stack.nats_url,
        "--stream-name",
        stream or stack.config.stream_name,
        "--subject-prefix",
        stack.config.subject_prefix,
    )


@dataclass
class ServiceProcess:
    """A `gpushare <service>` subprocess that can be killed and restarted with the same arguments."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    port: int = field(default_factory=free_port)
    port_flag: str = "--port"  # the node agent's is --metrics-port
    proc: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:<port>."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where this incarnation's stderr goes (one file per start)."""
        return self.log_dir / f"{self.name}.{self.starts}.log"

    def start(self) -> ServiceProcess:
        """Start (or restart) the process; stderr goes to a log file per incarnation."""
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                gpushare_command(*self.args, self.port_flag, str(self.port)),
                cwd=REPO,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, path: str = "/readyz", timeout_s: float = 60.0) -> None:
        """Poll until `path` answers 200; raise with the log tail if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready on {path} within {timeout_s}s:\n{self.log_tail()}")

    def kill9(self) -> None:
        """SIGKILL the process (no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.kills += 1

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after 15 s); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.proc.returncode

    def pause(self) -> None:
        """SIGSTOP: the process holds its connections but does nothing (a slow consumer)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def rss_kib(self) -> int:
        """Resident memory of the process in KiB, from /proc."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def all_logs(self) -> str:
        """Every incarnation's output, concatenated."""
        return "".join(
            (self.log_dir / f"{self.name}.{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
            if (self.log_dir / f"{self.name}.{i}.log").exists()
        )

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the current incarnation's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


# ----------------------------------------------------------------------------------------- invariants


@dataclass
class InvariantReport:
    """What the end-of-scenario check found (figures for docs/reliability.md)."""

    gpus: int = 0
    live_allocations: int = 0
    bound_pods: int = 0
    pending_pods: int = 0
    envs_checked: int = 0
    allocated_memory_mib: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no invariant is broken."""
        return not self.problems

    @property
    def settled(self) -> bool:
        """True when every invariant holds (waiting loops stop on it)."""
        return not self.problems

    def figures(self) -> dict[str, Any]:
        """The counts a scenario records beside its own figures (the first 10 problems)."""
        return {
            "bound_pods": self.bound_pods,
            "pending_pods": self.pending_pods,
            "live_allocations": self.live_allocations,
            "envs_checked": self.envs_checked,
            "problems": self.problems[:10],
        }


def env_problems(  # type: ignore[no-untyped-def]
    pod_name: str, alloc_id: str, alloc, envs: dict[str, dict[str, str]] | None, error: str | None = None
) -> list[str]:
    """What differs between the container environments a kubelet recorded for a pod and its live allocation:
    every container holding parts must have been given exactly its GPUs (NVIDIA_VISIBLE_DEVICES, in GPU index
    order), its per-GPU MiB (GPUSHARE_GPU_MEMORY_MIB) and its pod's total (ALIYUN_COM_GPU_MEM_POD)."""
    if envs is None:
        return [f"bound pod {pod_name} ({alloc.state.value}) has no container environment (admission: {error})"]
    out = []
    by_container: dict[str, list] = {}
    for part in alloc.parts:
        by_container.setdefault(part.container, []).append(part)
    for container, parts in sorted(by_container.items()):
        parts = sorted(parts, key=lambda p: p.gpu_index)
        env = envs.get(container)
        want = {
            "ALIYUN_COM_GPU_MEM_POD": str(sum(p.memory_mib for p in alloc.parts if not p.init) // 1024),
            "NVIDIA_VISIBLE_DEVICES": ",".join(p.gpu_uuid for p in parts),
            "ALIYUN_COM_GPU_MEM_IDX": ",".join(str(p.gpu_index) for p in parts),
            "GPUSHARE_GPU_MEMORY_MIB": ",".join(str(p.memory_mib) for p in parts),
        }
        got = {k: (env or {}).get(k) for k in want}
        if got == want:
            continue
        out.append(f"pod {pod_name} container {container}: environment {got} != allocation {want}")
    return out


async def settled_invariants(engine, stack, timeout_s: float = 60.0) -> InvariantReport:  # type: ignore[no-untyped-def]
    """`check_invariants` over the stack's nodes and kubelets, again every 2 s until nothing is broken or
    `timeout_s` passed (in-flight work settles meanwhile); the last report."""
    api = await stack.api_client()
    deadline = time.monotonic() + timeout_s
    while True:
        report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
        if report.settled or time.monotonic() > deadline:
            return report
        await asyncio.sleep(2)


async def check_invariants(engine, api, nodes: list[str], kubelets: dict | None = None) -> InvariantReport:  # type: ignore[no-untyped-def]
    """No GPU overcommitted; every pod bound to `nodes` and not ended (a pod kubelet refused at admission has
    failed) has exactly one live allocation there; every live allocation on `nodes` belongs to an existing,
    non-terminated pod with the same UID. With `kubelets`
    ({node: NodeKubelet} of the stack), every bound pod's recorded container environment matches its
    allocation (`env_problems`)."""
    from kubernetes_asyncio import client

    from shared.ledger.replay import load_state
    from shared.ledger.rules import gpu_charges, is_live

    report = InvariantReport()
    async with engine.connect() as conn:
        state = await load_state(conn)
    charged: dict[str, list[int]] = {u: [0, 0] for u in state.gpus}
    live_by_pod: dict[str, list] = {}
    for a_id, alloc in state.allocations.items():
        if not is_live(alloc.state):
            continue
        live_by_pod.setdefault(alloc.pod_uid, []).append((a_id, alloc))
        for gpu_uuid, (m, c) in gpu_charges(alloc.parts).items():
            charged.setdefault(gpu_uuid, [0, 0])
            charged[gpu_uuid][0] += m
            charged[gpu_uuid][1] += c
    for gpu_uuid, gpu in state.gpus.items():
        report.gpus += 1
        if not (0 <= gpu.allocated_memory_mib <= gpu.memory_mib and 0 <= gpu.allocated_compute <= gpu.compute_units):
            report.problems.append(f"GPU {gpu_uuid} overcommitted: {gpu.allocated_memory_mib}/{gpu.memory_mib} MiB")
        if charged[gpu_uuid] != [gpu.allocated_memory_mib, gpu.allocated_compute]:
            report.problems.append(f"GPU {gpu_uuid} counters {gpu} != live parts {charged[gpu_uuid]}")
        if not gpu.retired and gpu.node in nodes:
            report.allocated_memory_mib += gpu.allocated_memory_mib
    report.live_allocations = sum(len(v) for v in live_by_pod.values())
    pods = (await client.CoreV1Api(api).list_pod_for_all_namespaces()).items
    by_uid = {p.metadata.uid: p for p in pods}
    for pod in pods:
        if pod.spec.node_name in nodes:
            report.bound_pods += 1
            live = live_by_pod.get(pod.metadata.uid, [])
            if pod.status.phase in ("Succeeded", "Failed"):
                # e.g. refused by kubelet at admission (UnexpectedAdmissionError): it ran nothing, it holds nothing;
                # the loop over live allocations below names any it still has
                continue
            if len(live) != 1 or live[0][1].node != pod.spec.node_name:
                report.problems.append(
                    f"bound pod {pod.metadata.namespace}/{pod.metadata.name} on {pod.spec.node_name} has "
                    f"{len(live)} live allocations {[(str(i), a.node, a.state.value) for i, a in live]}"
                )
            elif kubelets is not None and pod.status.phase not in ("Succeeded", "Failed"):
                kubelet = kubelets[pod.spec.node_name]
                key = (pod.metadata.namespace, pod.metadata.name)
                envs = kubelet.envs.get(key)
                report.envs_checked += envs is not None
                report.problems += env_problems(
                    "/".join(key), str(live[0][0]), live[0][1], envs, kubelet.errors.get(key)
                )
        elif not pod.spec.node_name:
            report.pending_pods += 1
    for uid, live in live_by_pod.items():
        for _a_id, alloc in live:
            if alloc.node not in nodes:
                continue
            pod = by_uid.get(uid)
            if pod is None or pod.status.phase in ("Succeeded", "Failed"):
                report.problems.append(
                    f"live allocation of {alloc.namespace}/{alloc.pod_name} ({alloc.state.value}) has no running pod"
                )
            elif len(live) > 1:
                report.problems.append(f"pod {alloc.namespace}/{alloc.pod_name} has {len(live)} live allocations")
    return report
