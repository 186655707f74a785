"""6. Replay: fold 100,000 events from a private JetStream stream into a `LedgerState`.

Usage samples among them land on the samples stream, which a rebuild does not read: `events_read` counts
the ledger stream's share, `sample_events` the rest.

The stream holds a realistic mix: one inventory per node, then allocation life cycles interleaved as
they would be in a live cluster (reserved -> bound -> assigned per container -> released, a few
reserved -> failed), with health flaps and usage samples sprinkled in. `replay_state` is timed from the
first read to the folded state; figures are events/s of wall time (median over repeats) and events per
CPU-second of the replaying process (less sensitive to a loaded machine; excludes nats-server's work).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import deque
from typing import Any

from bench.common import BenchResult, Context, Target, median, private_bus
from shared.events.bus import EventBus
from shared.events.catalogue import (
    AllocationPart,
    AssignedEvent,
    BoundEvent,
    FailedEvent,
    GpuInfo,
    HealthEvent,
    InventoryEvent,
    ReleasedEvent,
    ReservedEvent,
    UsageEvent,
    UsageSample,
    encode_event,
    subject_for,
)
from shared.events.streams import SAMPLE_KINDS
from shared.ledger.replay import replay_state

NAME = "replay"
TITLE = "6. Replay: rebuild the ledger state from the stream"
GPU_MIB = 16 * 1024


def workload(total: int, *, nodes: int, gpus_per_node: int = 8, seed: int = 6) -> list[Any]:
    """A seeded, realistic event sequence of exactly `total` events."""
    rng = random.Random(seed)
    events: list[Any] = []
    for n in range(nodes):
        events.append(
            InventoryEvent(
                node=f"node-{n:05d}",
                driver_version="550.54.15",
                cuda_version="12.4",
                gpus=[
                    GpuInfo(
                        uuid=f"GPU-{n:05d}-{i}",
                        index=i,
                        model="NVIDIA A100-SXM4-16GB",
                        memory_mib=GPU_MIB,
                        memory_total_mib=GPU_MIB + 300,
                        pci_bus_id=f"0000:{i:02x}:00.0",
                    )
                    for i in range(gpus_per_node)
                ],
            )
        )
    pending: deque[list[Any]] = deque()  # each entry: the remaining events of one allocation's life
    while len(events) < total:
        roll = rng.random()
        if roll < 0.01:
            n = rng.randrange(nodes)
            i = rng.randrange(gpus_per_node)
            events.append(HealthEvent(node=f"node-{n:05d}", gpu_uuid=f"GPU-{n:05d}-{i}", healthy=rng.random() < 0.5))
            continue
        if roll < 0.03:
            n = rng.randrange(nodes)
            samples = [
                UsageSample(gpu_uuid=f"GPU-{n:05d}-{i}", used_memory_mib=rng.randrange(GPU_MIB), utilization_pct=50.0)
                for i in range(gpus_per_node)
            ]
            events.append(UsageEvent(node=f"node-{n:05d}", samples=samples))
            continue
        if pending and (len(pending) > 2000 or rng.random() < 0.75):
            life = pending[rng.randrange(min(len(pending), 64))] if rng.random() < 0.5 else pending[0]
            events.append(life.pop(0))
            if not life:
                pending.remove(life)
            continue
        n = rng.randrange(nodes)
        node = f"node-{n:05d}"
        gpu_count = 2 if rng.random() < 0.1 else 1
        containers = 2 if rng.random() < 0.15 else 1
        mib = rng.choice((1, 2, 4, 8)) * 1024
        first = rng.randrange(gpus_per_node - gpu_count + 1)
        parts = [
            AllocationPart(
                container=f"c{c}", container_index=c, gpu_uuid=f"GPU-{n:05d}-{g}", gpu_index=g, memory_mib=mib // 2
            )
            for c in range(containers)
            for g in range(first, first + gpu_count)
        ]
        alloc, pod = uuid.uuid4(), str(uuid.uuid4())
        events.append(
            ReservedEvent(
                allocation_id=alloc,
                pod_uid=pod,
                namespace=f"team-{rng.randrange(20)}",
                pod_name=f"job-{pod[:8]}",
                owner_kind="Job",
                owner_name=f"job-{pod[:4]}",
                node=node,
                parts=parts,
                source="extender",
            )
        )
        if rng.random() < 0.03:
            life = [FailedEvent(allocation_id=alloc, pod_uid=pod, node=node, reason="binding failed", source="binder")]
        else:
            life = [BoundEvent(allocation_id=alloc, pod_uid=pod, node=node, source="binder")]
            life += [
                AssignedEvent(
                    allocation_id=alloc,
                    pod_uid=pod,
                    node=node,
                    container=f"c{c}",
                    gpu_uuids=[f"GPU-{n:05d}-{g}" for g in range(first, first + gpu_count)],
                    source="node-agent",
                )
                for c in range(containers)
            ]
            life.append(ReleasedEvent(allocation_id=alloc, pod_uid=pod, node=node, reason="pod deleted"))
        pending.append(life)
    return events[:total]


async def publish_all(bus: EventBus, events: list[Any], *, timeout_s: float = 120.0) -> float:
    """Publish on core NATS (the streams store what their subjects match), then wait until the ledger and
    samples streams hold them all; returns events/s. Faster than one JetStream ack per event, and the stored
    messages are the same.
    """

    async def stored() -> int:
        names = bus.names
        return sum([(await bus.js.stream_info(s)).state.messages for s in (names.stream, names.samples_stream)])

    t0 = time.perf_counter()
    before = await stored()
    for i, e in enumerate(events):
        await bus.nc.publish(
            subject_for(bus.names.prefix, e), encode_event(e), headers={"Nats-Msg-Id": str(e.event_id)}
        )
        if i % 5000 == 4999:
            await bus.nc.flush(timeout=30)
    await bus.nc.flush(timeout=30)
    deadline = time.monotonic() + timeout_s
    while await stored() < before + len(events):
        if time.monotonic() > deadline:
            raise TimeoutError("the stream did not receive every published event")
        await asyncio.sleep(0.05)
    return len(events) / (time.perf_counter() - t0)


async def run(ctx: Context) -> BenchResult:
    """Publish the workload once, replay it `repeats` times."""
    total = ctx.pick(2_000, 100_000, 100_000)
    repeats = ctx.pick(1, 2, 3)
    nodes = ctx.pick(20, 500, 1000)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"events": total, "nodes": nodes, "repeats": repeats})
    result.targets.append(Target("events_per_s", ">=", 10_000))
    events = workload(total, nodes=nodes)
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    result.params["mix"] = kinds
    async with private_bus(ctx.nats_url, "replay") as bus:
        result.metrics["publish_events_per_s"] = round(await publish_all(bus, events), 1)
        rates, cpu_rates, states = [], [], None
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            state, stats = await replay_state(bus)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            rates.append(stats.events / elapsed)
            cpu_rates.append(stats.events / cpu)
            states = (state, stats)
    assert states is not None
    state, stats = states
    result.metrics["events_per_s"] = round(median(rates), 1)
    result.metrics["events_per_cpu_s"] = round(median(cpu_rates), 1)
    result.metrics["events_read"] = stats.events
    result.metrics["skipped"] = stats.skipped
    result.metrics["replay_s"] = round(stats.events / median(rates), 3)
    result.metrics["allocations"] = len(state.allocations)
    result.metrics["live_allocations"] = len(state.live_by_pod)
    ledger_events = sum(n for kind, n in kinds.items() if kind not in SAMPLE_KINDS)
    result.metrics["sample_events"] = total - ledger_events
    if stats.events != ledger_events:
        result.status = "error"
        result.notes.append(
            f"read {stats.events} events, published {ledger_events} to the ledger stream "
            f"(and {total - ledger_events} samples to the samples stream, which a rebuild does not read)"
        )
    return result
