"""Telling kube-scheduler that GPU capacity came back on a node.

When a pod ends, kube-scheduler may retry the pods waiting for GPU memory before the binder has
released the ended pod's share in the ledger; the extender refuses again, and kube-scheduler 1.20 then
parks those pods until its 60-second flush. A node update (a label change) moves them straight back to
the active queue, so after each release the binder stamps `gpushare.io/capacity-freed` on the node,
at most once a second per node.
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

    def __init__(self, api: client.ApiClient, *, min_interval_s: float = 1.0) -> None:
        self.api = api
        self.min_interval_s = min_interval_s
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._last: dict[str, float] = {}

    def capacity_freed(self, node: str) -> None:
        """Schedule a stamp on `node` (coalesced with any stamp already pending)."""
        if not node or node in self._pending:
            return
        self._pending[node] = asyncio.create_task(self._stamp(node))

    async def _stamp(self, node: str) -> None:
        try:
            wait = self._last.get(node, 0.0) + self.min_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last[node] = time.monotonic()
            body = {"metadata": {"labels": {LABEL: str(int(time.time() * 1000))}}}
            await client.CoreV1Api(self.api).patch_node(node, body)
        except Exception as exc:  # a missing node or a busy apiserver only delays the retry
            log.info("could not stamp %s on node %s: %r", LABEL, node, exc, extra={"node": node})
        finally:
            self._pending.pop(node, None)

    async def close(self) -> None:
        """Cancel pending stamps."""
        for task in list(self._pending.values()):
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)
