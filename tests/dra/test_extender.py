"""The extender beside DRA nodes: its view counts DRA shares (so /inspect shows them) and knows which nodes are DRA
nodes, and its filter never offers one of them to an aliyun.com/* pod (one GPU, one path)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.filter import without_dra_nodes
from services.extender.view import DRA_NODE, ClusterView
from shared.events.catalogue import InventoryEvent, NodeRetiredEvent
from shared.ledger.ledger import Ledger
from tests.dra.objects import gpu
from tests.dra.test_ledger import GPUS, NODE, claim_event


def test_the_view_counts_claim_shares_and_knows_the_dra_nodes() -> None:
    view = ClusterView()
    view.apply(InventoryEvent(node="dp", gpus=[gpu("dp", 0)]))
    view.apply(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))
    event = claim_event("4Gi", namespace="team")
    view.apply(event)
    assert view.dra_nodes == {NODE}
    assert [a.allocation_id for a in view.pods_on(NODE, GPUS[0].uuid)] == [event.allocation_id]
    assert view.namespace_usage("team") == (4096, 0)
    view.apply(InventoryEvent(node=NODE, gpus=GPUS))  # the node went back to the device plugins
    assert view.dra_nodes == set()
    view.apply(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))
    view.apply(NodeRetiredEvent(node=NODE))
    assert view.dra_nodes == set()


async def test_a_reloaded_view_knows_the_same(engine: AsyncEngine) -> None:
    ledger = Ledger(engine, prefix="t")
    await ledger.record(InventoryEvent(node="dp", gpus=[gpu("dp", 0)]))
    await ledger.record(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))
    event = claim_event("8Gi", namespace="team", g=1)
    await ledger.reserve_claim(event)
    view = ClusterView()
    await view.reload(engine)
    assert view.dra_nodes == {NODE} and set(view.nodes) == {"dp", NODE}
    assert [a.allocation_id for a in view.pods_on(NODE, GPUS[1].uuid)] == [event.allocation_id]
    assert view.namespace_usage("team") == (8192, 0)


def test_the_filter_moves_dra_nodes_to_never_fits_with_the_reason() -> None:
    passed, failed, never = without_dra_nodes(
        {"d1", "d2"}, ["a", "d1"], {"b": "full", "d2": "full"}, {"c": "no inventory"}
    )
    assert passed == ["a"] and failed == {"b": "full"}
    assert never == {"c": "no inventory", "d1": DRA_NODE, "d2": DRA_NODE}
