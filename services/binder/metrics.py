"""The binder's Prometheus metrics, on a registry of its own (one per Binder instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class BinderMetrics:
    """Counters and histograms the binder exports on /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.bindings = Counter(
            "gpushare_binder_bindings_total",
            "Reservations handled, by outcome (reason): bound, already_bound, failed_*, skipped_*",
            ["reason"],
            registry=r,
        )
        self.bind_seconds = Histogram(
            "gpushare_binder_bind_seconds",
            "Time from taking a reservation to its bound/failed ledger write",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.kube_retries = Counter(
            "gpushare_binder_kube_retries_total",
            "Kubernetes API calls retried after 429/5xx/connection errors",
            registry=r,
        )
        self.pod_reads_saved = Counter(
            "gpushare_binder_pod_reads_saved_total",
            "Bindings decided from the pod watch instead of a GET (API servers that ignore the Binding's UID)",
            registry=r,
        )
        self.released = Counter(
            "gpushare_binder_released_total",
            "Allocations released because their pod ended, vanished or its node was deleted",
            ["reason"],
            registry=r,
        )
        self.gateway_requests = Counter(
            "gpushare_binder_gateway_requests_total",
            "Node agents' snapshot requests and commands answered by the ledger gateway",
            ["verb"],
            registry=r,
        )
        self.annotations = Counter(
            "gpushare_binder_annotation_syncs_total",
            "Pod annotation updates after assignments and exchanges, by outcome",
            ["reason"],
            registry=r,
        )
        self.terminating = Counter(
            "gpushare_binder_terminating_total",
            "Allocations whose pod began terminating (the share stays held until the pod is gone)",
            registry=r,
        )
        self.adopted = Counter(
            "gpushare_binder_adopted_total",
            "Running pods with allocation annotations imported into the ledger by reconciliation",
            registry=r,
        )
        self.conflicts = Counter(
            "gpushare_binder_conflicts_total",
            "Pods whose claimed GPU shares the ledger cannot hold (or cannot read), by reason",
            ["reason"],
            registry=r,
        )
        self.reconciliations = Counter(
            "gpushare_binder_reconciliations_total", "Completed reconciliation passes", registry=r
        )
        self.reconcile_seconds = Histogram(
            "gpushare_binder_reconcile_seconds",
            "Duration of one reconciliation pass",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.claims = Counter(
            "gpushare_binder_claims_total",
            "DRA claim events handled by the binder, by outcome: reserved, refused_* (a gated pool's verdict), "
            "unrecorded_* (not recorded yet, tried again), ended, *_already",
            ["reason"],
            registry=r,
        )
        self.claim_record_refusals = Counter(
            "gpushare_binder_claim_record_refusals_total",
            "Claim allocations kube-scheduler made that the ledger refused to record, by reason (on a DRA pool "
            "without the gate this should never happen: each is logged and, when it persists, an event on the pod)",
            ["reason"],
            registry=r,
        )
        self.claim_templates = Counter(
            "gpushare_binder_claim_templates_total",
            "gpushare admission's ResourceClaimTemplates deleted once no pod used them for --template-grace, and "
            "written again because a new pod named one just deleted",
            ["outcome"],
            registry=r,
        )
        self.nodes_retired = Counter(
            "gpushare_binder_nodes_retired_total", "Nodes retired in the ledger after their deletion", registry=r
        )
        self.open_conflicts = Gauge(
            "gpushare_binder_open_conflicts", "Conflicts found by the last reconciliation pass", registry=r
        )

        self.leader = Gauge(
            "gpushare_binder_leader",
            "1 while this replica holds the binder lease (runs the watches, reconciliation and node nudges), "
            "0 on a standby",
            registry=r,
        )
        self.leader_changes = Counter(
            "gpushare_binder_leader_changes_total",
            "Changes of this replica's role: acquired, took_over (a failover), lost, released",
            ["change"],
            registry=r,
        )

    def leadership(self, leading: bool, change: str) -> None:
        """This replica's role changed (`shared.kube.leases.LeaderElector`'s `on_change`)."""
        self.leader.set(1 if leading else 0)
        self.leader_changes.labels(change=change).inc()

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests and logs), 0 when absent."""
        return self.registry.get_sample_value(name, labels or None) or 0.0
