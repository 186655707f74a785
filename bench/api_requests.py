"""What kube-apiserver did during a benchmark phase, from its own counters: requests by verb and resource, and
watch events sent to watchers.

`apiserver_request_total` counts every request the API server answered (labels `verb`, `resource`,
`subresource`, ...); `apiserver_watch_events_total` counts every event it sent to a watcher (one per watcher
per change, so it grows with the number of watches). The difference of two readings, divided by the phase's
pods, tells where the API server's CPU per pod goes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "apiserver_request"  # the parser drops the `_total` of counters
WATCH_EVENTS = "apiserver_watch_events"


def request_key(labels: dict[str, str]) -> str:
    """`VERB resource[/subresource]`, e.g. `POST pods/binding`."""
    resource = labels.get("resource", "") or "-"
    if labels.get("subresource"):
        resource += "/" + labels["subresource"]
    return f"{labels.get('verb', '?')} {resource}"


def parse_counts(exposition: str) -> Counter[str]:
    """Requests by `request_key`, and watch events sent as `WATCH-EVENT <resource>` (pure)."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition):
        if family.name not in (REQUESTS, WATCH_EVENTS):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == REQUESTS:
                counts[request_key(sample.labels)] += int(sample.value)
            else:
                # the label is `resource` on current API servers, `kind` on older ones
                kind = sample.labels.get("resource") or sample.labels.get("kind") or "?"
                counts[f"WATCH-EVENT {kind}"] += int(sample.value)
    return counts


async def read_counts(api: Any) -> Counter[str]:
    """The API server's counters now (its `/metrics`, read with the benchmark's credentials)."""
    resp = await api.call_api(
        "/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False, _request_timeout=30
    )
    async with resp:
        body = await resp.text()
    if resp.status != 200:
        raise RuntimeError(f"kube-apiserver /metrics answered {resp.status}: {body[:200]}")
    return parse_counts(body)


def per_pod(before: Counter[str], after: Counter[str], pods: int, prefix: str) -> dict[str, float]:
    """`{prefix}_api_requests_per_pod` (all requests, watches' events not included) and
    `{prefix}_watch_events_per_pod` (pure)."""
    delta = after - before
    requests = sum(v for k, v in delta.items() if not k.startswith("WATCH-EVENT "))
    events = sum(v for k, v in delta.items() if k.startswith("WATCH-EVENT "))
    return {
        f"{prefix}_api_requests_per_pod": round(requests / pods, 2),
        f"{prefix}_watch_events_per_pod": round(events / pods, 2),
    }


def breakdown(before: Counter[str], after: Counter[str], pods: int, top: int = 8) -> str:
    """The phase's largest counts per pod, as one line (pure)."""
    delta = after - before
    return ", ".join(f"{k} {v / pods:.2f}" for k, v in delta.most_common(top))
