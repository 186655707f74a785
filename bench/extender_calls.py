"""How many calls kube-scheduler made to the extender during a benchmark phase, by verb, from the extender's own
histograms (`gpushare_extender_<verb>_seconds_count`); per pod, more than one filter call means pods were
retried. `admission` counts kube-apiserver's calls to gpushare admission (DRA namespaces), served by the same
process."""

from __future__ import annotations

from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

VERBS = ("filter", "prioritize", "bind", "preempt", "admission")


def parse_calls(exposition: str) -> dict[str, float]:
    """{verb: calls answered so far, `<verb>_seconds`: the time spent answering them} (pure)."""
    calls: dict[str, float] = dict.fromkeys(VERBS, 0)
    for family in text_string_to_metric_families(exposition):
        for verb in VERBS:
            if family.name == f"gpushare_extender_{verb}_seconds":
                calls[verb] = int(sum(s.value for s in family.samples if s.name.endswith("_count")))
                calls[f"{verb}_seconds"] = sum(s.value for s in family.samples if s.name.endswith("_sum"))
    return calls


async def read_calls(extender_url: str) -> dict[str, float]:
    """The extender's calls by verb so far, and the seconds spent answering them (only its verbs' families are asked
    for)."""
    parts = urlsplit(extender_url)
    # prometheus_client restricts a page by sample names, so the `_count` and `_sum` samples are what is asked for
    params = [("name[]", f"gpushare_extender_{v}_seconds_{s}") for v in VERBS for s in ("count", "sum")]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{parts.scheme}://{parts.netloc}/metrics", params=params) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"extender /metrics answered {resp.status}: {body[:200]}")
    return parse_calls(body)


def per_pod(before: dict[str, float], after: dict[str, float], pods: int, prefix: str) -> dict[str, float]:
    """`{prefix}_extender_<verb>_calls_per_pod` and `..._<verb>_mean_ms` (the extender's own time to answer one) for
    the verbs called (pure)."""
    out: dict[str, float] = {}
    for v in VERBS:
        calls = after[v] - before[v]
        if calls > 0:
            out[f"{prefix}_extender_{v}_calls_per_pod"] = round(calls / pods, 2)
            spent = after.get(f"{v}_seconds", 0.0) - before.get(f"{v}_seconds", 0.0)
            out[f"{prefix}_extender_{v}_mean_ms"] = round(spent / calls * 1000, 2)
    return out
