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
# how long each admission webhook call took as kube-apiserver saw it (the round trip, TLS and the webhook's queue
# included), by webhook name; kept as `WEBHOOK-CALLS <name>` and `WEBHOOK-US <name>` (microseconds)
WEBHOOK_SECONDS = "apiserver_admission_webhook_admission_duration_seconds"
WEBHOOK = "WEBHOOK-"


def request_key(labels: dict[str, str]) -> str:
    """`VERB resource[/subresource]`, e.g. `POST pods/binding`."""
    resource = labels.get("resource", "") or "-"
    if labels.get("subresource"):
        resource += "/" + labels["subresource"]
    return f"{labels.get('verb', '?')} {resource}"


def parse_counts(exposition: str) -> Counter[str]:
    """Requests by `request_key`, watch events sent as `WATCH-EVENT <resource>`, and admission webhook calls and
    their time as `WEBHOOK-CALLS <name>` / `WEBHOOK-US <name>` (pure)."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition):
        if family.name == WEBHOOK_SECONDS:
            for sample in family.samples:
                name = sample.labels.get("name", "?")
                if sample.name.endswith("_count"):
                    counts[f"{WEBHOOK}CALLS {name}"] += int(sample.value)
                elif sample.name.endswith("_sum"):
                    counts[f"{WEBHOOK}US {name}"] += round(sample.value * 1e6)
            continue
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
    delta = _without_webhooks(after - before)
    requests = sum(v for k, v in delta.items() if not k.startswith("WATCH-EVENT "))
    events = sum(v for k, v in delta.items() if k.startswith("WATCH-EVENT "))
    return {
        f"{prefix}_api_requests_per_pod": round(requests / pods, 2),
        f"{prefix}_watch_events_per_pod": round(events / pods, 2),
    }


def breakdown(before: Counter[str], after: Counter[str], pods: int, top: int = 8) -> str:
    """The phase's largest counts per pod, as one line (pure)."""
    delta = _without_webhooks(after - before)
    return ", ".join(f"{k} {v / pods:.2f}" for k, v in delta.most_common(top))


def webhook_means(before: Counter[str], after: Counter[str], prefix: str) -> dict[str, float]:
    """`{prefix}_webhook_<name>_calls` and `{prefix}_webhook_<name>_mean_ms` for each admission webhook kube-apiserver
    called over the phase, `<name>` the webhook name's first label (`pods` for `pods.gpu.gpushare.io`) (pure)."""
    delta = after - before
    out: dict[str, float] = {}
    for key, calls in sorted(delta.items()):
        if not key.startswith(f"{WEBHOOK}CALLS "):
            continue
        name = key.split(" ", 1)[1]
        short = name.split(".", 1)[0]
        out[f"{prefix}_webhook_{short}_calls"] = calls
        out[f"{prefix}_webhook_{short}_mean_ms"] = round(delta.get(f"{WEBHOOK}US {name}", 0) / calls / 1000, 2)
    return out


def _without_webhooks(counts: Counter[str]) -> Counter[str]:
    return Counter({k: v for k, v in counts.items() if not k.startswith(WEBHOOK)})
