"""Leader election over a `coordination.k8s.io/v1` Lease, the way Kubernetes' own components elect one.

The rules are client-go's (`tools/leaderelection/leaderelection.go`: `tryAcquireOrRenew`, `renew`, `release`),
written here as a pure core and a thin async shell:

* Every replica reads the Lease every `retry_period` (a standby with up to 1.2x jitter, as `JitterUntil`).
  A replica that finds no Lease creates it and leads. A Lease held by another identity stands while it is
  *valid*: until `lease_duration` after this replica last **saw it change** (its own monotonic clock, never the
  holder's timestamps, so clocks need not agree). An expired or released Lease (empty holder) is taken with
  `leaseTransitions + 1`; the holder renews by writing `renewTime`. Every write is a PUT with the
  resourceVersion read, so of two replicas racing for the same Lease only one wins (409 for the other).
* The leader stops leading when it has not renewed for `renew_deadline` (shorter than `lease_duration`), by its
  own clock, whether or not the API server answers: by the time a standby may take an expired Lease, the old
  leader has already stood down.
* On a clean stop the leader releases the Lease (holder emptied, duration 1 s), so a standby takes over
  within one `retry_period` instead of waiting out the lease.

Nothing here is a consensus of our own: the API server's optimistic concurrency on one object decides.

    elector = LeaderElector(api, ElectionConfig("gpushare-binder", namespace="gpushare-system", identity=pod))
    await elector.run(stop, duties)   # duties(term_ended) runs while this replica leads
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.kube.raw import read_json
from shared.kube.retry import describe_failure

log = logging.getLogger(__name__)

JITTER = 1.2  # client-go's JitterFactor: a standby waits retry_period * (1 + up to 1.2)
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


# ------------------------------------------------------------------------------------------------ pure core


@dataclass(frozen=True)
class ElectionTiming:
    """client-go's three durations (Kubernetes components default to 15 s, 10 s and 2 s)."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if min(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s) <= 0:
            raise ValueError("lease duration, renew deadline and retry period must all be positive")
        if self.lease_duration_s <= self.renew_deadline_s:
            raise ValueError(
                f"the lease duration ({self.lease_duration_s:g}s) must be longer than the renew deadline "
                f"({self.renew_deadline_s:g}s): a leader must stand down before a standby may take the lease"
            )
        if self.renew_deadline_s <= JITTER * self.retry_period_s:
            raise ValueError(
                f"the renew deadline ({self.renew_deadline_s:g}s) must be longer than {JITTER:g} x the retry "
                f"period ({self.retry_period_s:g}s), or one slow attempt costs the leadership"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as leader election reads and writes it."""

    holder: str = ""
    duration_s: int = 0
    acquired_at: datetime | None = None
    renewed_at: datetime | None = None
    transitions: int = 0

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        """The record in a Lease object as the API returns it (JSON)."""
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_s=int(spec.get("leaseDurationSeconds") or 0),
            acquired_at=_parse_time(spec.get("acquireTime")),
            renewed_at=_parse_time(spec.get("renewTime")),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> dict[str, Any]:
        """The Lease spec to write (times as MicroTime: RFC 3339 with exactly six fractional digits)."""
        return {
            "holderIdentity": self.holder or None,
            "leaseDurationSeconds": self.duration_s,
            "acquireTime": _format_time(self.acquired_at),
            "renewTime": _format_time(self.renewed_at),
            "leaseTransitions": self.transitions,
        }


@dataclass(frozen=True)
class Observation:
    """The record this replica last read and the moment (its monotonic clock) it first saw that record."""

    record: LeaseRecord | None = None
    since: float = 0.0


class Action(StrEnum):
    """What one election round does."""

    CREATE = "create"  # no Lease yet: create it, holding it
    ACQUIRE = "acquire"  # free, released or expired: take it
    RENEW = "renew"  # ours: write a new renewTime
    STAND_BY = "stand_by"  # another replica holds a valid lease


@dataclass(frozen=True)
class Decision:
    """An election round's outcome: the action and the record to write (None when standing by).
    `took_over` marks a failover: the lease is taken from another holder whose lease expired."""

    action: Action
    record: LeaseRecord | None = None
    took_over: bool = False


def observe(previous: Observation | None, record: LeaseRecord | None, now: float) -> Observation:
    """The observation after reading `record` at `now`: its clock restarts only when the record changed."""
    if previous is not None and previous.record == record:
        return previous
    return Observation(record, now)


def lease_valid(observation: Observation, now: float) -> bool:
    """Whether the observed lease still binds others: `duration` has not passed since it last changed."""
    record = observation.record
    return record is not None and observation.since + record.duration_s > now


def decide(
    current: LeaseRecord | None,
    observation: Observation,
    me: str,
    *,
    now: float,
    wall: datetime,
    timing: ElectionTiming,
) -> Decision:
    """Acquire, renew or stand by, from the Lease as just read (`current`, None when there is none) and what
    this replica has observed of it (`observe` it first). `now` is the monotonic clock, `wall` the time written
    into the Lease."""
    duration = max(1, round(timing.lease_duration_s))
    fresh = LeaseRecord(holder=me, duration_s=duration, acquired_at=wall, renewed_at=wall)
    if current is None:
        return Decision(Action.CREATE, fresh)
    if current.holder == me:
        return Decision(Action.RENEW, replace(current, duration_s=duration, renewed_at=wall))
    if current.holder and lease_valid(observation, now):
        return Decision(Action.STAND_BY)
    return Decision(Action.ACQUIRE, replace(fresh, transitions=current.transitions + 1), took_over=bool(current.holder))


def released(current: LeaseRecord, wall: datetime) -> LeaseRecord:
    """What a leader writes when it steps down cleanly: no holder, a 1 s lease, the transitions kept."""
    return LeaseRecord(holder="", duration_s=1, acquired_at=wall, renewed_at=wall, transitions=current.transitions)


def still_leading(renewed: float | None, now: float, timing: ElectionTiming) -> bool:
    """A leader leads until `renew_deadline` after its last successful write (None: it never led)."""
    return renewed is not None and now < renewed + timing.renew_deadline_s


def standby_wait(timing: ElectionTiming, draw: float) -> float:
    """Seconds a standby waits between rounds, `draw` in [0, 1) (client-go's JitterUntil)."""
    return timing.retry_period_s * (1 + JITTER * draw)


def _format_time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def default_identity() -> str:
    """This replica's identity: the host name, which in Kubernetes is the pod's name (unique among replicas and
    kept across container restarts, so a restarted leader resumes at once)."""
    return socket.gethostname()


def default_namespace() -> str:
    """Where the Lease lives: $POD_NAMESPACE, else the service account's namespace, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    return "default"


# ------------------------------------------------------------------------------------------------ the shell


@dataclass(frozen=True)
class ElectionConfig:
    """Which Lease a replica competes for, as whom, and how fast."""

    name: str
    namespace: str = field(default_factory=default_namespace)
    identity: str = field(default_factory=default_identity)
    timing: ElectionTiming = ElectionTiming()


Duties = Callable[[asyncio.Event], Coroutine[Any, Any, None]]
OnChange = Callable[[bool, str], None]


class LeaderElector:
    """Runs the election for one Lease and, while this replica leads, its duties.

    `on_change(leading, change)` hears each change of role: `acquired` (a free, released or new lease),
    `took_over` (a failover: another holder's lease had expired), `lost` (not renewed within the deadline) and
    `released` (stepped down on stop).
    """

    def __init__(
        self,
        api: client.ApiClient,
        config: ElectionConfig,
        *,
        on_change: OnChange | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.namespace = config.namespace
        self.name = config.name
        self.identity = config.identity
        self.timing = config.timing
        self.on_change = on_change
        self.clock = clock
        self.observation = Observation()
        self._renewed: float | None = None  # monotonic time of our last successful write as holder
        self._lease: dict[str, Any] | None = None  # the Lease as last read or written (its resourceVersion)
        self._leading = False  # the role the duties were last started / stopped for
        self.failure = ""  # why the last round failed ('' when it did not)
        # whether a round of the election has ended (answered or not), so that the role is this replica's own finding
        # and not merely the standby it starts as (a replica that would lead must not report ready as a standby)
        self.decided = False

    @property
    def is_leader(self) -> bool:
        """Whether this replica leads now (it renewed within the deadline)."""
        return still_leading(self._renewed, self.clock(), self.timing)

    @property
    def role(self) -> str:
        """`leader` or `standby`."""
        return "leader" if self.is_leader else "standby"

    @property
    def holder(self) -> str:
        """The holder this replica last saw ('' when none)."""
        record = self.observation.record
        return record.holder if record is not None else ""

    def describe(self) -> dict[str, Any]:
        """The role and the lease, for /healthz and /status."""
        return {
            "role": self.role,
            "lease": f"{self.namespace}/{self.name}",
            "identity": self.identity,
            "holder": self.holder,
        }

    async def run(self, stop: asyncio.Event, duties: Duties | None = None) -> None:
        """Take part in the election until `stop`; run `duties(term_ended)` while leading (term_ended is set when
        the term ends, and the duties are cancelled if they do not return soon after). A duty that fails ends
        the election too (the lease is released) and the error is raised."""
        term: tuple[asyncio.Event, asyncio.Task[None]] | None = None
        try:
            while not stop.is_set():
                if term is not None and term[1].done():
                    term[1].result()  # a duty that returned (or failed) on its own: raise its error
                    raise RuntimeError(f"the duties of lease {self.name} ended while leading")
                await self._round()
                self.decided = True
                leading = self.is_leader
                if leading != self._leading:
                    self._leading = leading
                    if not leading:
                        self._changed(False, "lost")
                if leading and term is None and duties is not None:
                    ended = asyncio.Event()
                    term = (ended, asyncio.create_task(duties(ended), name=f"lead-{self.name}"))
                elif not leading and term is not None:
                    await _end_term(term)
                    term = None
                await self._pause(stop, term)
        finally:
            if term is not None:
                await _end_term(term)
            if self.is_leader:
                await self._release()

    async def _pause(self, stop: asyncio.Event, term: tuple[asyncio.Event, asyncio.Task[None]] | None) -> None:
        """Until the next round: a retry period (a standby's jittered), but never past the renew deadline, and
        no longer once `stop` is set or a duty ends."""
        if self.is_leader:
            assert self._renewed is not None
            wait = min(self.timing.retry_period_s, self._renewed + self.timing.renew_deadline_s - self.clock())
        else:
            wait = standby_wait(self.timing, random.random())
        waiters = {asyncio.ensure_future(stop.wait())}
        if term is not None:
            waiters.add(term[1])  # type: ignore[arg-type]
        try:
            await asyncio.wait(waiters, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                if term is None or waiter is not term[1]:
                    waiter.cancel()

    async def _round(self) -> None:
        """One `tryAcquireOrRenew`, bounded so that a hanging API server cannot keep a stale leader leading."""
        budget = self.timing.renew_deadline_s
        if self.is_leader:
            assert self._renewed is not None
            budget = self._renewed + self.timing.renew_deadline_s - self.clock()
        try:
            await asyncio.wait_for(self._try(), timeout=max(0.05, budget))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an answer we cannot use, or no answer: try again next round
            failure = _failure(exc)
            # losing a race for the lease is the election working; anything else (no answer, a refusal such as a
            # missing RBAC rule) is said once, when it starts, and again when it changes
            raced = isinstance(exc, ApiException) and exc.status == 409
            level = logging.DEBUG if raced or failure == self.failure else logging.WARNING
            log.log(level, "lease %s/%s: %s", self.namespace, self.name, failure, extra={"lease": self.name})
            self.failure = "" if raced else failure
            return
        if self.failure:
            log.info("lease %s/%s: the API server answers again", self.namespace, self.name)
        self.failure = ""

    async def _try(self) -> None:
        coordination = client.CoordinationV1Api(self.api)
        now, wall = self.clock(), datetime.now(UTC)
        try:
            lease: dict[str, Any] | None = await read_json(
                await coordination.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = None
        current = LeaseRecord.from_lease(lease) if lease is not None else None
        self.observation = observe(self.observation, current, now)
        decision = decide(current, self.observation, self.identity, now=now, wall=wall, timing=self.timing)
        if decision.action is Action.STAND_BY:
            return
        assert decision.record is not None
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": decision.record.spec(),
            }
            written = await read_json(
                await coordination.create_namespaced_lease(self.namespace, body, _preload_content=False)
            )
        else:
            body = {**lease, "spec": decision.record.spec()}  # metadata keeps the resourceVersion read
            written = await read_json(
                await coordination.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False)
            )
        self._lease = written
        self.observation = Observation(LeaseRecord.from_lease(written), now)
        self._renewed = now
        if not self._leading:
            self._leading = True
            self._changed(True, "took_over" if decision.took_over else "acquired")

    async def _release(self) -> None:
        """Step down: empty the holder so that a standby need not wait out the lease (best effort)."""
        coordination = client.CoordinationV1Api(self.api)

        async def release() -> None:
            lease = await read_json(
                await coordination.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            )
            current = LeaseRecord.from_lease(lease)
            if current.holder != self.identity:
                return
            body = {**lease, "spec": released(current, datetime.now(UTC)).spec()}
            await read_json(
                await coordination.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False)
            )

        try:
            await asyncio.wait_for(release(), timeout=self.timing.renew_deadline_s)
        except Exception as exc:  # the lease then expires by itself
            log.warning("lease %s/%s: could not release it: %s", self.namespace, self.name, _failure(exc))
        self._renewed = None
        if self._leading:
            self._leading = False
            self._changed(False, "released")

    def _changed(self, leading: bool, change: str) -> None:
        log.info(
            "lease %s/%s: %s (%s)",
            self.namespace,
            self.name,
            "leading" if leading else "standing by",
            change,
            extra={"lease": self.name, "identity": self.identity, "change": change},
        )
        if self.on_change is not None:
            self.on_change(leading, change)


async def _end_term(term: tuple[asyncio.Event, asyncio.Task[None]], grace_s: float = 2.0) -> None:
    """Tell the duties the term ended, give them `grace_s` to return, then cancel them."""
    ended, task = term
    ended.set()
    with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(asyncio.shield(task), grace_s)
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _failure(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer from the API server in time"
    if isinstance(exc, ApiException) and exc.status == 409:
        return "another replica wrote the lease first"
    return describe_failure(exc)
