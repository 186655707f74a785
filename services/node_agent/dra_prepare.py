"""Preparing gpushare ResourceClaims for kubelet: the ledger's record in, a CDI spec out (the DRA plugin's work).

kubelet calls `NodePrepareResources` with all of a pod's claims of this driver before the pod's containers start
(pkg/kubelet/cm/dra/manager.go `prepareResources`, v1.37.2), and again after a restart of either side: preparing
is idempotent and needs no memory, only the ledger and the files. For each claim the agent

1. reads the claim from the API, and its shares as the binder did (`shared.dra.claims.claim_shares`: the same
   shares, the same allocation id);
2. checks that the ledger holds that very allocation live on this node: kube-scheduler binds the pod as soon as it
   wrote the claim's allocation and the binder records it from its claim watch, so kubelet may ask a moment before
   the record reaches the agent; the agent waits for it in its view of the ledger (the node's events) up to
   `dra_ledger_wait_s`, reloads the view once, and refuses a claim the ledger still does not hold: no container
   starts on a share the ledger does not hold. kubelet retries a refused pod at its next update (the binder
   annotates the pod right after the record) or resync (pkg/kubelet/pod_workers.go, v1.37.2). Which container
   holds each share comes from that record (`from_record`: the binder read it from the pod spec), so the pod is
   not read; only when the record cannot say it for certain (two containers holding alike shares of one GPU, or
   another pod reserving the claim now) is the pod read and the claim read as the binder read it (`read_claim`);
3. writes the claim's CDI spec: per request, the environment the device-plugin path gives a container
   (`assignment.container_env`: NVIDIA_VISIBLE_DEVICES, gpushare's ALIYUN_COM_GPU_MEM_*, the memory limits and, under
   MPS, its limits and client directories);
4. records each container that holds a share of the claim as `assigned` in the ledger (through the binder's
   gateway; the binder then sets `ALIYUN_COM_GPU_MEM_ASSIGNED=true` on the pod; the ledger keeps the parts of
   holders only, so another container using a holder's share has nothing of its own to stamp);
5. answers one `Device` per allocation result, the request's CDI device on its first result.

`NodeUnprepareResources` removes the spec file (also of a claim that is long gone). Capacity is given back by the
binder when the pod ends, as on device-plugin nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.node_agent.assignment import PendingContainer, Share, container_env, device_list
from services.node_agent.ledger_link import CommandRefused, LedgerUnavailable
from services.node_agent.mps import client_mounts
from shared.dra import cdi
from shared.dra.claims import (
    ClaimAllocation,
    ClaimRefused,
    LedgerGpu,
    Recorded,
    claim_allocation_id,
    claim_shares,
    from_record,
    our_results,
    pod_consumer,
    read_claim,
)
from shared.dra.slices import device_name
from shared.events.catalogue import AllocationPart, AssignedEvent

log = logging.getLogger(__name__)

_EPOCH = datetime.fromtimestamp(0, UTC)
ObjectReader = Callable[[str, str], Awaitable[dict[str, Any] | None]]  # (namespace, name) -> object or None (404)


class PrepareError(Exception):
    """A claim that cannot be prepared (the message goes to kubelet and the pod's events)."""


@dataclass(frozen=True)
class PreparedDevice:
    """One allocation result as kubelet gets it back."""

    request: str
    pool: str
    device: str
    share_id: str
    cdi_ids: tuple[str, ...]


class ClaimPreparer:
    """Prepares and unprepares the claims of one node."""

    def __init__(
        self,
        agent: Any,
        *,
        read_claim_object: ObjectReader,
        read_pod: ObjectReader,
        cdi_dir: Path,
    ) -> None:
        self.agent = agent
        self.read_claim_object = read_claim_object
        self.read_pod = read_pod
        self.cdi_dir = Path(cdi_dir)
        self.prepared = 0
        self.refused = 0
        self.pod_reads = 0  # prepares whose holders the ledger's record could not name (the pod was read)

    # -- prepare ------------------------------------------------------------------------------------------------
    async def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        """Prepare one claim; raises PrepareError with a message for kubelet."""
        node = self.agent.config.node
        try:
            devices = await self._prepare(namespace, uid, name)
        except PrepareError as exc:
            self.refused += 1
            self.agent.metrics.dra_prepares.labels(node, "refused").inc()
            log.warning(
                "claim %s/%s not prepared: %s",
                namespace,
                name,
                exc,
                extra={"claim": f"{namespace}/{name}", "claim_uid": uid, "node": self.agent.config.node},
            )
            raise
        self.prepared += 1
        self.agent.metrics.dra_prepares.labels(node, "prepared").inc()
        return devices

    async def _prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        node = self.agent.config.node
        claim = await self.read_claim_object(namespace, name)
        if claim is None or (claim.get("metadata") or {}).get("uid") != uid:
            raise PrepareError(f"claim {namespace}/{name} ({uid}) does not exist (any more)")
        if not our_results(claim):
            raise PrepareError(f"claim {namespace}/{name} has no allocation of a gpushare GPU")
        try:
            consumer = pod_consumer(claim)
            if consumer is None:
                raise PrepareError(f"claim {namespace}/{name} is reserved for no pod")
            gpus = self._gpus()
            claim_node, shares = claim_shares(claim, gpus, self.agent.config.unit)
        except ClaimRefused as exc:
            raise PrepareError(exc.message) from None
        if claim_node != node:
            raise PrepareError(f"claim {namespace}/{name} is allocated on node {claim_node}, not on {node}")
        allocation_id = claim_allocation_id(claim, shares)
        await self._check_ledger(allocation_id, f"{namespace}/{name}")
        allocation = from_record(claim, shares, self._recorded(allocation_id))
        if allocation is None:  # the record cannot say who holds each share: the pod's spec does
            self.pod_reads += 1
            pod = await self.read_pod(namespace, str(consumer.get("name") or ""))
            if pod is None or (pod.get("metadata") or {}).get("uid") != consumer.get("uid"):
                raise PrepareError(f"the pod claim {namespace}/{name} is reserved for does not exist (any more)")
            try:
                allocation = read_claim(claim, pod, gpus, self.agent.config.unit)
            except ClaimRefused as exc:
                raise PrepareError(exc.message) from None
        self._write_spec(allocation)
        await self._record_assigned(allocation)
        return self._devices(allocation)

    def _recorded(self, allocation_id: uuid.UUID) -> Recorded:
        """The ledger's record of one allocation as the node's view holds it."""
        held = self.agent.view.containers_of(allocation_id)
        if not held:
            return Recorded("", "", None, ())
        return Recorded(
            pod_uid=held[0].pod_uid,
            pod_name=held[0].pod_name,
            pod_created_at=held[0].pod_created_at,
            parts=tuple(
                AllocationPart(
                    container=c.container,
                    container_index=c.container_index,
                    gpu_uuid=s.gpu_uuid,
                    gpu_index=s.gpu_index,
                    memory_mib=s.memory_mib,
                    compute=s.compute,
                    init=c.init,
                    sidecar=c.sidecar,
                )
                for c in held
                for s in c.shares
            ),
        )

    def _gpus(self) -> dict[str, LedgerGpu]:
        return {
            device_name(g.uuid): LedgerGpu(g.uuid, g.index, g.memory_mib, g.compute_units)
            for g in self.agent.gpu_infos()
        }

    async def _check_ledger(self, allocation_id: uuid.UUID, claim: str) -> None:
        """The ledger must hold this allocation live on the node: the view as the node's events bring it (up to
        `dra_ledger_wait_s`), then a fresh snapshot once. How long it waited is observed (0: held at once)."""
        view, started = self.agent.view, time.monotonic()
        deadline = started + self.agent.config.dra_ledger_wait_s
        while view.version(allocation_id) is None and time.monotonic() < deadline:
            changed = self.agent.view_changed()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - time.monotonic()))
        if view.version(allocation_id) is None:
            await self.agent.reload_view()
        self.agent.metrics.dra_ledger_wait.labels(self.agent.config.node).observe(time.monotonic() - started)
        if view.version(allocation_id) is None:
            raise PrepareError(
                f"the gpushare ledger holds no live allocation {allocation_id} for claim {claim} on "
                f"{self.agent.config.node}: refusing to hand out a GPU share the ledger did not record (the binder "
                "records each claim allocation as it appears; kubelet will ask again)"
            )

    def _env(self, allocation: ClaimAllocation, request: str) -> tuple[dict[str, str], list[tuple[str, str, bool]]]:
        """The environment (and mounts) of the containers that use one request: `container_env` of its holder."""
        holder = allocation.users[request][0]
        shares = allocation.shares_of(request)
        container = PendingContainer(
            allocation_id=allocation.allocation_id,
            pod_uid=allocation.pod_uid,
            namespace=allocation.namespace,
            pod_name=allocation.pod_name,
            container=holder.name,
            container_index=holder.index,
            init=holder.init,
            sidecar=holder.init,
            shares=tuple(
                sorted(
                    (Share(s.gpu_uuid, s.gpu_index, s.memory_mib, s.compute) for s in shares), key=lambda s: s.gpu_index
                )
            ),
            reserved_at=allocation.pod_created_at or _EPOCH,
            pod_memory_mib=allocation.pod_memory_mib(),
        )
        assigner = self.agent.assigner
        client = assigner.mps_root is not None and assigner.mps_root.running()
        env = container_env(
            container,
            assigner.gpu_memory_mib(),
            assigner.gpu_total_mib(),
            self.agent.config.unit,
            mps=assigner.mps or client,
        )
        if client and assigner.mps_root is not None:
            env = {**env, **assigner.mps_root.client_env()}
        env, devices = device_list(env, self.agent.config.device_list_strategy)
        mounts = [(host, path, False) for host, path in client_mounts(env)]
        mounts += [(host, path, True) for path, host in devices]
        return env, mounts

    def _write_spec(self, allocation: ClaimAllocation) -> None:
        envs, mounts = {}, {}
        for request in allocation.requests():
            envs[request], mounts[request] = self._env(allocation, request)
        spec = cdi.cdi_spec(allocation.claim_uid, envs, mounts)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        path = self.cdi_dir / cdi.spec_file_name(allocation.claim_uid)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(spec, indent=2))
        os.replace(tmp, path)  # the runtime never reads a half-written spec

    async def _record_assigned(self, allocation: ClaimAllocation) -> None:
        """Each container using the claim is `assigned` in the ledger (skipped when the view says so already)."""
        link, view, node = self.agent.link, self.agent.view, self.agent.config.node
        assigned = {(c.allocation_id, c.container) for c in view.containers() if c.assigned}
        for request in allocation.requests():
            gpu_uuids = sorted({s.gpu_uuid for s in allocation.shares_of(request)})
            for user in allocation.users[request]:
                if (allocation.allocation_id, user.name) in assigned:
                    continue
                event = AssignedEvent(
                    allocation_id=allocation.allocation_id,
                    pod_uid=allocation.pod_uid,
                    node=node,
                    container=user.name,
                    gpu_uuids=gpu_uuids,
                    source="node-agent",
                )
                try:
                    await link.send(event, deadline_s=self.agent.config.ledger_deadline_s)
                except (LedgerUnavailable, CommandRefused) as exc:
                    raise PrepareError(f"the gpushare ledger could not record the assignment: {exc}") from None
                view.apply(event)

    @staticmethod
    def _devices(allocation: ClaimAllocation) -> list[PreparedDevice]:
        out, first = [], set()
        for s in allocation.shares:
            ids = () if s.request in first else (cdi.device_id(allocation.claim_uid, s.request),)
            first.add(s.request)
            out.append(PreparedDevice(s.request, s.pool, s.device, s.share_id, ids))
        return out

    # -- unprepare ----------------------------------------------------------------------------------------------
    def unprepare(self, uid: str) -> bool:
        """Remove a claim's CDI spec (True when there was one); idempotent."""
        path = self.cdi_dir / cdi.spec_file_name(uid)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True
