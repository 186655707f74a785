"""Prometheus metrics of the extender (one set per process)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

FILTER_SECONDS = Histogram("gpushare_extender_filter_seconds", "Time to answer a filter call", buckets=_BUCKETS)
PRIORITIZE_SECONDS = Histogram(
    "gpushare_extender_prioritize_seconds", "Time to answer a prioritize call", buckets=_BUCKETS
)
BIND_SECONDS = Histogram("gpushare_extender_bind_seconds", "Time to answer a bind call", buckets=_BUCKETS)
PREEMPT_SECONDS = Histogram("gpushare_extender_preempt_seconds", "Time to answer a preempt call", buckets=_BUCKETS)
NODE_DECISIONS = Counter(
    "gpushare_extender_node_decisions_total",
    "Filter verdicts per node (reason: fits, full, never_fits, quota)",
    ["reason"],
)
REFUSALS = Counter("gpushare_extender_refusals_total", "Pods for which filter left no node, by main reason", ["reason"])
BIND_OUTCOMES = Counter(
    "gpushare_extender_binds_total",
    "Bind answers by outcome (bound, failed, timeout, no_fit, quota, unknown_pod, invalid)",
    ["reason"],
)
RESYNCS = Counter("gpushare_extender_resyncs_total", "Full reloads of the in-memory view from the ledger", ["reason"])
GC_SECONDS = Histogram(
    "gpushare_extender_gc_seconds",
    "Garbage collections after a view reload (kind: young, or full every 20th), requests held meanwhile",
    ["kind"],
    buckets=_BUCKETS,
)
BIND_POD_READS = Counter(
    "gpushare_extender_bind_pod_reads_total",
    "Pods bind reserved for, by where the pod came from (watch: the unbound-pod watch; api: a GET)",
    ["source"],
)
ADMISSIONS = Counter(
    "gpushare_extender_admissions_total",
    "gpushare admission reviews by outcome (rewritten, dry_run, unchanged, ignored, refused, malformed, failed)",
    ["reason"],
)
CLAIM_ADMISSIONS = Counter(
    "gpushare_extender_claim_admissions_total",
    "gpushare ResourceClaims reviewed at creation against their namespace's GiB quota, by outcome (held: a hold "
    "recorded; no_quota; dry_run; quota: refused over quota; refused: a claim that cannot be counted; failed: the "
    "ledger did not answer; unchanged: not a gpushare claim; ignored; malformed)",
    ["reason"],
)
ADMISSION_SECONDS = Histogram(
    "gpushare_extender_admission_seconds",
    "Time to answer a gpushare admission review (template creation included)",
    buckets=_BUCKETS,
)
