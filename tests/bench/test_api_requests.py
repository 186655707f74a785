"""kube-apiserver's counters, as benchmark 3 reads them."""

from __future__ import annotations

from collections import Counter

from bench.api_requests import breakdown, parse_counts, per_pod, webhook_means

EXPOSITION = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests.
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",resource="pods",subresource="binding",verb="POST",version="v1"} 7
apiserver_request_total{code="409",resource="pods",subresource="binding",verb="POST",version="v1"} 1
apiserver_request_total{code="200",resource="pods",subresource="",verb="GET",version="v1"} 3
# HELP apiserver_watch_events_total [ALPHA] Number of events sent in watch clients
# TYPE apiserver_watch_events_total counter
apiserver_watch_events_total{group="",resource="pods",version="v1"} 40
apiserver_watch_events_total{group="",kind="Node",version="v1"} 2
# HELP apiserver_request_duration_seconds [STABLE] Response latency.
# TYPE apiserver_request_duration_seconds histogram
apiserver_request_duration_seconds_bucket{verb="GET",resource="pods",le="0.1"} 3
apiserver_request_duration_seconds_count{verb="GET",resource="pods"} 3
# HELP apiserver_admission_webhook_admission_duration_seconds [STABLE] Admission webhook latency.
# TYPE apiserver_admission_webhook_admission_duration_seconds histogram
apiserver_admission_webhook_admission_duration_seconds_bucket{name="pods.gpu.gpushare.io",rejected="false",le="+Inf"} 4
apiserver_admission_webhook_admission_duration_seconds_sum{name="pods.gpu.gpushare.io",rejected="false"} 0.2
apiserver_admission_webhook_admission_duration_seconds_count{name="pods.gpu.gpushare.io",rejected="false"} 4
apiserver_admission_webhook_admission_duration_seconds_sum{name="pods.gpu.gpushare.io",rejected="true"} 0.1
apiserver_admission_webhook_admission_duration_seconds_count{name="pods.gpu.gpushare.io",rejected="true"} 1
"""


def test_requests_are_counted_by_verb_and_resource_and_watch_events_by_kind() -> None:
    counts = parse_counts(EXPOSITION)
    assert counts == Counter(
        {
            "POST pods/binding": 8,
            "GET pods": 3,
            "WATCH-EVENT pods": 40,
            "WATCH-EVENT Node": 2,
            "WEBHOOK-CALLS pods.gpu.gpushare.io": 5,
            "WEBHOOK-US pods.gpu.gpushare.io": 300000,
        }
    )


def test_webhook_calls_are_averaged_over_the_phase_and_kept_out_of_the_request_counts() -> None:
    before = Counter(
        {"GET pods": 5, "WEBHOOK-CALLS claims.gpu.gpushare.io": 10, "WEBHOOK-US claims.gpu.gpushare.io": 1000}
    )
    after = Counter(
        {"GET pods": 25, "WEBHOOK-CALLS claims.gpu.gpushare.io": 30, "WEBHOOK-US claims.gpu.gpushare.io": 201000}
    )
    assert webhook_means(before, after, "x") == {"x_webhook_claims_calls": 20, "x_webhook_claims_mean_ms": 10.0}
    assert per_pod(before, after, 20, "x") == {"x_api_requests_per_pod": 1.0, "x_watch_events_per_pod": 0.0}
    assert breakdown(before, after, 20) == "GET pods 1.00"


def test_per_pod_figures_are_the_differences_over_the_phase() -> None:
    before = Counter({"POST pods/binding": 10, "GET pods": 5, "WATCH-EVENT Pod": 100})
    after = Counter({"POST pods/binding": 30, "GET pods": 5, "PATCH pods": 10, "WATCH-EVENT Pod": 180})
    assert per_pod(before, after, 20, "x") == {"x_api_requests_per_pod": 1.5, "x_watch_events_per_pod": 4.0}
    assert breakdown(before, after, 20, top=2) == "WATCH-EVENT Pod 4.00, POST pods/binding 1.00"


def test_ledger_counts_per_pod_are_the_differences_over_the_phase() -> None:
    from bench.db_counts import per_pod as db_per_pod

    before = {"xact_commit": 100, "xact_rollback": 0, "tup_inserted": 10, "tup_updated": 5, "tup_deleted": 0}
    after = {"xact_commit": 130, "xact_rollback": 1, "tup_inserted": 70, "tup_updated": 45, "tup_deleted": 20}
    assert db_per_pod(before, after, 20, "p") == {"p_db_transactions_per_pod": 1.5, "p_db_rows_written_per_pod": 6.0}


def test_rows_written_by_table_are_listed_largest_first() -> None:
    from bench.db_counts import tables_breakdown

    before = {"xact_commit": 1, "rows:outbox": 10, "rows:gpus": 5}
    after = {"xact_commit": 9, "rows:outbox": 50, "rows:gpus": 5, "rows:allocations": 20}
    assert tables_breakdown(before, after, 10) == "outbox 4.00, allocations 2.00"


def test_extender_calls_are_counted_by_verb() -> None:
    from bench.extender_calls import parse_calls
    from bench.extender_calls import per_pod as calls_per_pod

    exposition = (
        "# TYPE gpushare_extender_filter_seconds histogram\n"
        'gpushare_extender_filter_seconds_bucket{le="+Inf"} 30.0\n'
        "gpushare_extender_filter_seconds_count 30.0\n"
        "gpushare_extender_filter_seconds_sum 0.5\n"
        "# TYPE gpushare_extender_bind_seconds histogram\n"
        'gpushare_extender_bind_seconds_bucket{le="+Inf"} 10.0\n'
        "gpushare_extender_bind_seconds_count 10.0\n"
        "gpushare_extender_bind_seconds_sum 1.5\n"
        "# TYPE gpushare_extender_admission_seconds histogram\n"  # kube-apiserver's calls to gpushare admission
        "gpushare_extender_admission_seconds_count 5.0\n"
    )
    calls = parse_calls(exposition)
    assert {v: calls[v] for v in ("filter", "prioritize", "bind", "preempt", "admission")} == {
        "filter": 30,
        "prioritize": 0,
        "bind": 10,
        "preempt": 0,
        "admission": 5,
    }
    assert (calls["filter_seconds"], calls["bind_seconds"], calls["admission_seconds"]) == (0.5, 1.5, 0)
    before = {"filter": 10, "prioritize": 0, "bind": 0, "preempt": 0, "admission": 0, "filter_seconds": 0.1}
    assert calls_per_pod(before, calls, 10, "gpu") == {
        "gpu_extender_filter_calls_per_pod": 2.0,
        "gpu_extender_filter_mean_ms": 20.0,  # 0.4 s over 20 calls
        "gpu_extender_bind_calls_per_pod": 1.0,
        "gpu_extender_bind_mean_ms": 150.0,
        "gpu_extender_admission_calls_per_pod": 0.5,
        "gpu_extender_admission_mean_ms": 0.0,
    }
