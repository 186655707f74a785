"""Simulated GPU usage for fake GPUs (pure): workload profiles per pod, and the processes they would run.

On a machine without GPUs (`--fake-gpus`) nothing uses GPU memory, so usage, over-use, right-sizing and the HPA
metric would stay empty. `--simulate-usage RULES` gives the fake GPUs workloads: each container that kubelet
started on the node (the agent's view: assigned app containers and sidecars) runs one simulated process per GPU
share, holding a fraction of its share that follows the profile of the first rule matching its pod:

    PATTERN=SHAPE[,sm:F][;PATTERN=SHAPE...]      or  @FILE (one rule per line, `#` comments; re-read when it changes)

    PATTERN  a glob on NAMESPACE/POD (`gpushare-demo/bert-training-*`, `team-a/*`, `*`); a bare word is a
             namespace (`team-a` = `team-a/*`)
    SHAPE    steady:F              F of the share (0.65 = 65 %; above 1 is over-use)
             ramp:F1:F2:SECONDS    from F1 to F2 over SECONDS after the container started, then F2
             spike:F1:F2:EVERY:FOR F1, and F2 for FOR seconds every EVERY seconds (from the container's start)
             idle                  no process at all (the pod holds its share and uses none)
    sm:F     the processes keep F of the GPU's SMs busy (0.05 = 5 %; `sm:0` is a share whose compute idles);
             without it: the container's compute share times the memory fraction, or its memory's part of the GPU

Everything the agent does with real processes then happens to these: the processes carry PIDs whose
`<proc-root>/<pid>/cgroup` names the pod as kubelet's systemd cgroup driver would, so the agent's real mapping
finds the pod, and samples, the usage stream, accounting, metrics and over-use detection follow unchanged.
Simulated PIDs lie above Linux's largest possible PID (2^22), so they can never name a real process.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.node_agent.assignment import PendingContainer

PID_BASE = 4_194_304 + 1  # PID_MAX_LIMIT on 64-bit Linux is 2^22: no real process has a PID this large
MAX_FRACTION = 4.0
_NUMBER = r"(\d+(?:\.\d+)?)"


class ProfileError(ValueError):
    """A `--simulate-usage` rule that cannot be understood (the message names it and says what was expected)."""


@dataclass(frozen=True)
class Shape:
    """How a simulated process's memory follows time: a fraction of its share at `seconds` after it started."""

    kind: str  # steady | ramp | spike | idle
    low: float = 0.0
    high: float = 0.0
    period_s: float = 0.0
    duration_s: float = 0.0

    def fraction(self, seconds: float) -> float | None:
        """The fraction of the share in use `seconds` after the start (None: no process)."""
        t = max(seconds, 0.0)
        if self.kind == "idle":
            return None
        if self.kind == "ramp":
            if self.period_s <= 0 or t >= self.period_s:
                return self.high
            return self.low + (self.high - self.low) * t / self.period_s
        if self.kind == "spike":
            return self.high if math.fmod(t, self.period_s) < self.duration_s else self.low
        return self.low

    def __str__(self) -> str:
        if self.kind == "ramp":
            return f"ramp:{self.low:g}:{self.high:g}:{self.period_s:g}"
        if self.kind == "spike":
            return f"spike:{self.low:g}:{self.high:g}:{self.period_s:g}:{self.duration_s:g}"
        return "idle" if self.kind == "idle" else f"steady:{self.low:g}"


@dataclass(frozen=True)
class Rule:
    """Pods whose `namespace/name` matches `pattern` run `shape`, keeping `sm` of the GPU's SMs busy (0..1; None:
    derived from the share)."""

    pattern: str
    shape: Shape
    sm: float | None = None

    def matches(self, namespace: str, pod: str) -> bool:
        """Whether the rule applies to this pod."""
        return fnmatch.fnmatchcase(f"{namespace}/{pod}", self.pattern)

    def __str__(self) -> str:
        return f"{self.pattern}={self.shape}" + (f",sm:{self.sm:g}" if self.sm is not None else "")


_SHAPES = {
    "steady": (re.compile(rf"^steady:{_NUMBER}$"), "steady:F, e.g. steady:0.65"),
    "ramp": (re.compile(rf"^ramp:{_NUMBER}:{_NUMBER}:{_NUMBER}$"), "ramp:F1:F2:SECONDS, e.g. ramp:0.2:0.9:300"),
    "spike": (
        re.compile(rf"^spike:{_NUMBER}:{_NUMBER}:{_NUMBER}:{_NUMBER}$"),
        "spike:F1:F2:EVERY:FOR, e.g. spike:0.5:1.3:60:10",
    ),
}


def parse_shape(text: str) -> Shape:
    """A shape from its text; ProfileError naming what was expected."""
    raw = text.strip().lower()
    if raw == "idle":
        return Shape("idle")
    kind = raw.split(":", 1)[0]
    if kind not in _SHAPES:
        raise ProfileError(f"unknown usage shape {text.strip()!r}: expected steady, ramp, spike or idle")
    pattern, example = _SHAPES[kind]
    m = pattern.match(raw)
    if m is None:
        raise ProfileError(f"bad usage shape {text.strip()!r}: expected {example}")
    numbers = [float(g) for g in m.groups()]
    fractions = numbers[:2] if kind != "steady" else numbers[:1]
    if any(f > MAX_FRACTION for f in fractions):
        raise ProfileError(f"bad usage shape {text.strip()!r}: fractions are 0..{MAX_FRACTION:g} of the share")
    if kind == "steady":
        return Shape("steady", low=numbers[0])
    if kind == "ramp":
        return Shape("ramp", low=numbers[0], high=numbers[1], period_s=numbers[2])
    every, duration = numbers[2], numbers[3]
    if every <= 0 or duration > every:
        raise ProfileError(f"bad usage shape {text.strip()!r}: EVERY must be positive and FOR at most EVERY")
    return Shape("spike", low=numbers[0], high=numbers[1], period_s=every, duration_s=duration)


_SM = re.compile(rf"^sm:{_NUMBER}$")


def parse_sm(text: str) -> float:
    """The `sm:F` part of a rule: a fraction of the GPU's SMs from 0 to 1; ProfileError naming what was expected."""
    m = _SM.match(text.strip().lower())
    if m is None or float(m.group(1)) > 1:
        raise ProfileError(f"bad SM part {text.strip()!r}: expected sm:F with F from 0 to 1, e.g. sm:0.05")
    return float(m.group(1))


def parse_rules(text: str) -> list[Rule]:
    """Rules from `PATTERN=SHAPE[,sm:F]` items separated by `;` or new lines (`#` starts a comment)."""
    rules = []
    for line in re.split(r"[;\n]", text):
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        pattern, sep, shape = item.partition("=")
        pattern = pattern.strip()
        if not sep or not pattern or not shape.strip():
            raise ProfileError(f"bad usage rule {item!r}: expected PATTERN=SHAPE, e.g. gpushare-demo/*=steady:0.6")
        if "/" not in pattern:
            pattern = f"{pattern}/*" if pattern != "*" else "*"
        shape, comma, sm = shape.partition(",")
        rules.append(Rule(pattern, parse_shape(shape), parse_sm(sm) if comma else None))
    return rules


def rule_for(rules: Iterable[Rule], namespace: str, pod: str) -> Rule | None:
    """The first rule matching the pod (None: no rule, no process)."""
    return next((r for r in rules if r.matches(namespace, pod)), None)


def shape_for(rules: Iterable[Rule], namespace: str, pod: str) -> Shape | None:
    """The shape of the first rule matching the pod (None: no rule, no process)."""
    rule = rule_for(rules, namespace, pod)
    return rule.shape if rule is not None else None


@dataclass(frozen=True)
class SimulatedProcess:
    """One simulated process: its PID, the pod it belongs to (as its cgroup says) and what it holds on a GPU."""

    pid: int
    pod_uid: str
    container_id: str
    gpu_uuid: str
    used_memory_mib: int
    utilization_pct: float
    sm_pct: float | None = None  # the rule's `sm:F` as a percent of the GPU (None: derived, see `sm_percent`)

    @property
    def cgroup(self) -> str:
        """`/proc/<pid>/cgroup` as kubelet's systemd cgroup driver and containerd lay it out (cgroup v2)."""
        uid = self.pod_uid.replace("-", "_")
        return (
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/"
            f"cri-containerd-{self.container_id}.scope\n"
        )


@dataclass
class UsageSimulation:
    """Turns the node's started containers and the rules into simulated processes, round after round.

    It remembers when it first saw each container (its start, for ramps and spikes) and the PID it gave it.
    """

    rules: list[Rule]
    started: dict[tuple[str, str], float] = field(default_factory=dict)
    pids: dict[tuple[str, str], int] = field(default_factory=dict)
    _next_pid: int = PID_BASE

    def step(self, containers: Iterable[PendingContainer], now: float) -> list[SimulatedProcess]:
        """The simulated processes at time `now` (seconds, any monotonic clock)."""
        out = []
        running = set()
        for c in sorted(containers, key=lambda c: (c.pod_uid, c.container)):
            if not (c.assigned and c.long_running and c.pod_uid and c.shares):
                continue
            rule = rule_for(self.rules, c.namespace, c.pod_name)
            key = (c.pod_uid, c.container)
            running.add(key)
            start = self.started.setdefault(key, now)
            fraction = rule.shape.fraction(now - start) if rule is not None else None
            if fraction is None:
                continue
            pid = self.pids.get(key)
            if pid is None:
                pid = self.pids[key] = self._next_pid
                self._next_pid += 1
            container_id = hashlib.sha256(f"{c.pod_uid}/{c.container}".encode()).hexdigest()
            for s in c.shares:
                out.append(
                    SimulatedProcess(
                        pid=pid,
                        pod_uid=c.pod_uid,
                        container_id=container_id,
                        gpu_uuid=s.gpu_uuid,
                        used_memory_mib=round(s.memory_mib * fraction),
                        utilization_pct=min(100.0, (s.compute or 0) * fraction) if s.compute else 0.0,
                        sm_pct=100.0 * rule.sm if rule is not None and rule.sm is not None else None,
                    )
                )
        for key in [k for k in self.started if k not in running]:  # the container ended: its process too
            del self.started[key]
            self.pids.pop(key, None)
        return out


def sm_percent(process: SimulatedProcess, gpu_memory_mib: int) -> float:
    """The percent of its GPU's SMs a simulated process keeps busy: its rule's `sm:F`, else its compute share in
    use, else its memory's part of the GPU (at most 100)."""
    if process.sm_pct is not None:
        return min(100.0, process.sm_pct)
    return min(100.0, process.utilization_pct or 100.0 * process.used_memory_mib / max(gpu_memory_mib, 1))


def utilization(processes: Iterable[SimulatedProcess], gpu_memory_mib: dict[str, int]) -> dict[str, float]:
    """GPU UUID -> utilisation percent: the processes' `sm_percent`, summed and capped at 100."""
    out: dict[str, float] = {}
    for p in processes:
        part = sm_percent(p, gpu_memory_mib.get(p.gpu_uuid, 0))
        out[p.gpu_uuid] = min(100.0, out.get(p.gpu_uuid, 0.0) + part)
    return out
