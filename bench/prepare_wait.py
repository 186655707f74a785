"""How long kubelet's NodePrepareResources waited on the DRA nodes for the ledger to hold each claim, and how many
were refused, from the node agents' own metrics (`gpushare_node_agent_dra_prepare_ledger_wait_seconds`, a
histogram, and `gpushare_node_agent_dra_prepares_total{outcome}`): read before and after a phase, summed over the
DRA pool's agents. Without the gate kube-scheduler binds a pod as soon as PreBind wrote its claim's allocation,
so kubelet may ask a moment before the binder's record reaches the agent; this is what that costs a pod."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

WAIT = "gpushare_node_agent_dra_prepare_ledger_wait_seconds"
PREPARES = "gpushare_node_agent_dra_prepares_total"


@dataclass
class Reading:
    """Summed over agents: the histogram's cumulative buckets (upper bound -> count), its sum and count, and the
    prepares by outcome."""

    buckets: dict[float, float] = field(default_factory=dict)
    total_s: float = 0.0
    count: float = 0.0
    outcomes: dict[str, float] = field(default_factory=dict)

    def add(self, exposition: str) -> None:
        """Add one agent's /metrics page (pure)."""
        for family in text_string_to_metric_families(exposition):
            for s in family.samples:
                if s.name == f"{WAIT}_bucket":
                    bound = float(s.labels["le"])
                    self.buckets[bound] = self.buckets.get(bound, 0.0) + s.value
                elif s.name == f"{WAIT}_sum":
                    self.total_s += s.value
                elif s.name == f"{WAIT}_count":
                    self.count += s.value
                elif s.name == PREPARES:
                    outcome = s.labels.get("outcome", "")
                    self.outcomes[outcome] = self.outcomes.get(outcome, 0.0) + s.value


def quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile `q` of cumulative `buckets` (pure; 0 when empty)."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return 0.0
    want = q * ordered[-1][1]
    return next(bound for bound, n in ordered if n >= want)


def figures(before: Reading, after: Reading, prefix: str) -> dict[str, float]:
    """`<prefix>_prepare_*`: prepares, refusals, the mean wait and bucket bounds of p50 / p99 / the longest, over the
    phase (pure)."""
    buckets = {b: after.buckets.get(b, 0.0) - before.buckets.get(b, 0.0) for b in after.buckets}
    count = after.count - before.count
    out = {
        f"{prefix}_prepare_calls": count,
        f"{prefix}_prepare_refused": after.outcomes.get("refused", 0.0) - before.outcomes.get("refused", 0.0),
        f"{prefix}_prepare_ledger_wait_mean_ms": round((after.total_s - before.total_s) / count * 1000, 2)
        if count
        else 0.0,
        f"{prefix}_prepare_ledger_wait_p50_le_ms": quantile(buckets, 0.5) * 1000,
        f"{prefix}_prepare_ledger_wait_p99_le_ms": quantile(buckets, 0.99) * 1000,
        f"{prefix}_prepare_ledger_wait_max_le_ms": quantile(buckets, 1.0) * 1000,
    }
    return {k: (v if v != float("inf") else -1.0) for k, v in out.items()}


async def read(urls: list[str]) -> Reading:
    """The DRA node agents' readings, summed (`urls`: each agent's base URL)."""
    reading = Reading()
    async with aiohttp.ClientSession() as session:

        async def one(url: str) -> str:
            async with session.get(f"{url}/metrics") as resp:
                return await resp.text()

        for page in await asyncio.gather(*(one(u) for u in urls)):
            reading.add(page)
    return reading
