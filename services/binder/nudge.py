"""Telling kube-scheduler that GPU capacity came back on a node.

When a pod ends, kube-scheduler may retry the pods waiting for GPU memory before the binder has
released the ended pod's share in the ledger; the extender refuses again, and kube-scheduler then parks
those pods (1.20 until its 60-second flush, current releases until the next cluster event: a pod that an
extender refused is requeued by any event). A node update (a label change) moves them straight back to
the active queue, so after each release the binder stamps `gpushare.io/capacity-freed` on the node, at
most once a second per node. The extenders learn of the release from the event stream a moment later, so
the retry that the first stamp causes may still be refused: a follow-up stamp `settle_s` after the last
release on the node makes kube-scheduler try again once every extender has caught up.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kubernetes_asyncio import client

log = logging.getLogger(__name__)

LABEL = "gpushare.io/capacity-freed"


class CapacityNudger:
    """Debounced node-label stamps after capacity is given back."""

    def __init__(self, api: client.ApiClient, *, min_interval_s: float = 1.0, settle_s: float = 2.0) -> None:
        self.api = api
        self.min_interval_s = min_interval_s
        self.settle_s = settle_s
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        self._last: dict[str, float] = {}

    def capacity_freed(self, node: str) -> None:
        """Schedule a stamp on `node` now and a follow-up after `settle_s` (coalesced with pending ones)."""
        if not node:
            return
        if node in self._pending:
            self._dirty.add(node)
            return
        self._pending[node] = asyncio.create_task(self._stamps(node))

    async def _stamps(self, node: str) -> None:
        try:
            await self._stamp(node)
            while True:  # one follow-up after the last release seen on the node settles
                self._dirty.discard(node)
                await asyncio.sleep(self.settle_s)
                await self._stamp(node)
                if node not in self._dirty:
                    return
        except Exception as exc:  # a missing node or a busy apiserver only delays the retry
            log.info("could not stamp %s on node %s: %r", LABEL, node, exc, extra={"node": node})
        finally:
            self._pending.pop(node, None)
            self._dirty.discard(node)

    async def _stamp(self, node: str) -> None:
        wait = self._last.get(node, 0.0) + self.min_interval_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last[node] = time.monotonic()
        body = {"metadata": {"labels": {LABEL: str(int(time.time() * 1000))}}}
        await client.CoreV1Api(self.api).patch_node(node, body)

    async def close(self) -> None:
        """Cancel pending stamps."""
        for task in list(self._pending.values()):
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)
