"""`gpushare binder`: bind reserved pods, release ended ones, reconcile the ledger with the cluster."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from shared.settings import Settings

if TYPE_CHECKING:
    from shared.kube.leases import ElectionConfig

log = logging.getLogger("gpushare.binder")


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def _not_negative(value: str) -> float:
    number = float(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def _count(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 256:
        raise argparse.ArgumentTypeError(f"must be between 1 and 256, got {value}")
    return number


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the `binder` subcommand."""
    p = subparsers.add_parser(
        "binder",
        parents=[common],
        help="bind reserved pods to their nodes and keep the ledger true to the cluster",
        description="Consume `reserved` events and create each pod's Binding with its GPU annotations, "
        "release allocations of pods that ended, retire deleted nodes, and reconcile the ledger with "
        "the cluster at start and periodically (releasing orphans, adopting annotated pods).",
    )
    p.add_argument("--port", type=int, default=8081, help="HTTP port for /healthz /readyz /metrics (default 8081)")
    p.add_argument("--host", default="0.0.0.0", help="HTTP listen address (default 0.0.0.0)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube)")
    p.add_argument(
        "--reconcile-interval", type=_positive, default=60.0, help="seconds between reconciliations (default 60)"
    )
    p.add_argument(
        "--reserve-grace",
        type=_positive,
        default=30.0,
        help="never release a reservation younger than this many seconds (default 30)",
    )
    p.add_argument("--concurrency", type=_count, default=16, help="reservations bound in parallel (default 16)")
    p.add_argument(
        "--template-grace",
        type=_not_negative,
        default=600.0,
        help="delete a ResourceClaimTemplate gpushare admission wrote once no pod has used it for this many seconds "
        "(default 600; 0: never delete)",
    )
    lease = p.add_argument_group(
        "leader election",
        "Every replica binds and serves the node agents; the pod and node watches, reconciliation and node nudges "
        "run on one replica, the holder of a coordination.k8s.io Lease (docs/binder.md, 'Replicas').",
    )
    lease.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="elect one replica for the cluster-wide duties (default on; --no-leader-elect: this process does "
        "them, for exactly one replica)",
    )
    lease.add_argument("--lease-name", default="gpushare-binder", help="the Lease's name (default gpushare-binder)")
    lease.add_argument(
        "--lease-namespace",
        default=None,
        help="the Lease's namespace (default: $POD_NAMESPACE, else the service account's namespace, else default)",
    )
    lease.add_argument(
        "--lease-identity",
        default=None,
        help="this replica's name in the Lease, unique among replicas (default: the host name, i.e. the pod's name)",
    )
    lease.add_argument(
        "--lease-duration",
        type=_positive,
        default=10.0,
        help="seconds a standby waits after the lease last changed before taking it (default 10)",
    )
    lease.add_argument(
        "--renew-deadline",
        type=_positive,
        default=7.0,
        help="seconds the leader keeps leading without a successful renewal (default 7)",
    )
    lease.add_argument(
        "--retry-period", type=_positive, default=2.0, help="seconds between election rounds (default 2)"
    )
    p.set_defaults(func=run)


def election_config(args: argparse.Namespace) -> ElectionConfig | None:
    """The leader election the flags ask for (None with --no-leader-elect); ValueError names a bad timing."""
    from shared.kube.leases import ElectionConfig, ElectionTiming, default_identity, default_namespace

    if not args.leader_elect:
        return None
    timing = ElectionTiming(args.lease_duration, args.renew_deadline, args.retry_period)
    return ElectionConfig(
        args.lease_name,
        namespace=args.lease_namespace or default_namespace(),
        identity=args.lease_identity or default_identity(),
        timing=timing,
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run the binder until SIGTERM / SIGINT."""
    from shared.runtime import run_main

    return run_main(_main(args, settings))


async def _main(args: argparse.Namespace, settings: Settings) -> int:
    from kubernetes_asyncio.config.config_exception import ConfigException

    from services.binder.app import make_app
    from services.binder.service import Binder, BinderConfig
    from shared.kube.client import api_client
    from shared.runtime import Listen, ServiceRuntime

    settings.require_database_url()
    settings.require_nats_url()
    try:
        election = election_config(args)
    except ValueError as exc:
        log.error("leader election: %s", exc)
        return 2
    try:
        api = await api_client(args.kubeconfig)
    except (ConfigException, OSError) as exc:
        log.error("cannot reach Kubernetes: %s", exc)
        return 2
    config = BinderConfig(
        unit=settings.resource_memory_unit,
        concurrency=args.concurrency,
        reconcile_interval_s=args.reconcile_interval,
        reserve_grace_s=args.reserve_grace,
        election=election,
        template_grace_s=args.template_grace,
    )
    try:
        async with ServiceRuntime("binder", settings, pool_size=5, listen=Listen(args.host, args.port)) as rt:
            assert rt.ledger is not None and rt.bus is not None
            binder = Binder(rt.ledger, rt.bus, api, config)
            binder.metrics.registry.register(rt.ledger_metrics())
            rt.spawn(binder.run(rt.stop))
            await rt.serve(make_app(binder))
    finally:
        await api.close()
    return 0
