"""Projections: every event lands once, redelivery changes nothing, rebuild reproduces the answers."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from services.accounting import projections
from services.accounting.tables import pending, timeline, usage_samples
from shared.events.catalogue import RefusedEvent
from shared.ledger.replay import read_events

from .conftest import Stack, cli, seed


async def _counts(s: Stack) -> tuple[int, int, int]:
    async with s.engine.connect() as conn:
        return (
            (await conn.execute(select(func.count()).select_from(timeline))).scalar_one(),
            (await conn.execute(select(func.count()).select_from(pending))).scalar_one(),
            (await conn.execute(select(func.count()).select_from(usage_samples))).scalar_one(),
        )


async def test_timeline_pending_and_usage_are_projected(seeded: Stack) -> None:
    r = await seeded.client.get("/v1/pods/team-a/bert-1")
    assert r.status_code == 200
    body = r.json()
    assert [step["step"] for step in body["timeline"]] == ["reserved", "bound", "assigned"]
    assert body["status"] == "assigned" and body["pending"] is None  # refused earlier, then reserved
    assert [step["step"] for step in (await seeded.client.get("/v1/pods/team-b/old-0")).json()["timeline"]] == [
        "reserved",
        "released",
    ]
    failed = (await seeded.client.get("/v1/pods/team-c/flaky-0")).json()
    assert failed["status"] == "failed"
    assert failed["timeline"][-1] == {
        **failed["timeline"][-1],
        "step": "failed",
        "detail": "binding refused: node gone",
    }
    assert await _counts(seeded) == (3 + 2 + 3 + 2 + 2, 1, 5 + 2)


async def test_applying_an_event_twice_changes_nothing(seeded: Stack) -> None:
    before = await _counts(seeded)
    events = [e async for e in read_events(seeded.bus)]
    events += [e async for e in read_events(seeded.bus, stream=seeded.bus.names.samples_stream)]
    assert len(events) > 20
    async with seeded.engine.begin() as conn:
        results = [await projections.apply(conn, e) for e in events]
    assert not any(r.new for r in results)
    assert await _counts(seeded) == before
    # Redelivering through the consumer path too.
    for e in events[:5]:
        await seeded.consumer.handler(e)
    assert await _counts(seeded) == before


async def test_latest_refusal_wins_and_older_ones_do_not_overwrite(seeded: Stack) -> None:
    body = (await seeded.client.get("/v1/pods/team-b/huge-0")).json()
    assert body["status"] == "pending"
    assert body["pending"]["summary"] == "0/2 nodes fit: needs 20 GiB on one GPU"
    assert body["pending"]["reasons"]["node-0"] == "needs 20 GiB on one GPU, largest free 13 GiB"
    old = RefusedEvent(
        pod_uid="uid-big",
        namespace="team-b",
        pod_name="huge-0",
        summary="stale",
        occurred_at=seeded.seeded_at - timedelta(hours=1),
    )
    await seeded.bus.publish(old)
    await seeded.settle()
    again = (await seeded.client.get("/v1/pods/team-b/huge-0")).json()
    assert again["pending"]["summary"] == "0/2 nodes fit: needs 20 GiB on one GPU"


REBUILD_PATHS = (
    "/v1/cluster",
    "/v1/nodes",
    "/v1/nodes/node-0",
    "/v1/nodes/node-1",
    "/v1/allocations?limit=100",
    "/v1/pods/team-a/bert-1",
    "/v1/pods/team-b/train-0",
    "/v1/pods/team-b/huge-0",
    "/v1/pods/team-c/flaky-0",
    "/v1/pending",
    "/v1/quotas",
)


async def _answers(s: Stack, window: str) -> dict[str, object]:
    paths = [*REBUILD_PATHS, f"/v1/usage/namespaces?{window}", f"/v1/usage/workloads?{window}"]
    paths.append(f"/v1/rightsizing?{window}&step_mib=512")
    out = {}
    for path in paths:
        r = await s.client.get(path)
        assert r.status_code == 200, (path, r.text)
        out[path] = r.json()
    return out


async def test_rebuild_yields_the_same_answers(stack: Stack, database_url: str, nats_url: str) -> None:
    s = await seed(stack)
    until = s.seeded_at
    since = until - timedelta(hours=2)
    window = f"since={since.isoformat().replace('+', '%2B')}&until={until.isoformat().replace('+', '%2B')}"
    before = await _answers(s, window)
    assert before["/v1/pending"]["items"], "the seed has a pending pod"
    # Wreck the projections, then rebuild them through the real command line.
    async with s.engine.begin() as conn:
        await projections.truncate_projections(conn)
    assert (await s.client.get("/v1/pods/team-b/huge-0")).status_code == 404
    code = await cli(
        "ledger",
        "rebuild",
        "--database-url",
        database_url,
        "--nats-url",
        nats_url,
        "--stream-name",
        s.bus.names.stream,
        "--subject-prefix",
        s.bus.names.prefix,
    )
    assert code == 0
    after = await _answers(s, window)
    for path in before:
        assert after[path] == before[path], path
    # A direct rebuild returns how many events it applied.
    assert (
        await projections.rebuild_projections(s.engine, s.bus, None) == 3 + 5 + 3 + 2 + 1 + 1 + 6
    )  # refused, reserved, bound, assigned, released, failed, usage


async def test_a_rebuild_after_the_snapshot_trimmed_the_whole_stream_keeps_the_rows(seeded: Stack) -> None:
    """The ledger snapshot purges every event all consumers read: an empty ledger stream then holds nothing to
    rebuild from, and the rows derived from what is gone must stay (they were emptied, as for a stream that never
    had an event, and `gpushare ledger rebuild` lost accounting's whole timeline)."""
    s = seeded
    async with s.engine.connect() as conn:
        before = (await conn.execute(select(func.count()).select_from(timeline))).scalar_one()
    assert before > 0
    await s.bus.js.purge_stream(s.bus.names.stream)  # what trim_ledger_stream does when everything is covered
    assert (await s.bus.js.stream_info(s.bus.names.stream)).state.messages == 0
    await projections.rebuild_projections(s.engine, s.bus, None)
    async with s.engine.connect() as conn:
        after = (await conn.execute(select(func.count()).select_from(timeline))).scalar_one()
    assert after == before
