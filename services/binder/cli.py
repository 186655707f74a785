"""`gpushare binder`: bind reserved pods, release ended ones, reconcile the ledger with the cluster."""

from __future__ import annotations

import argparse
import logging

from shared.settings import Settings

log = logging.getLogger("gpushare.binder")


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
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
    p.set_defaults(func=run)


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
        api = await api_client(args.kubeconfig)
    except (ConfigException, OSError) as exc:
        log.error("cannot reach Kubernetes: %s", exc)
        return 2
    config = BinderConfig(
        unit=settings.resource_memory_unit,
        concurrency=args.concurrency,
        reconcile_interval_s=args.reconcile_interval,
        reserve_grace_s=args.reserve_grace,
    )
    try:
        async with ServiceRuntime("binder", settings, pool_size=5, listen=Listen(args.host, args.port)) as rt:
            assert rt.ledger is not None and rt.bus is not None
            binder = Binder(rt.ledger, rt.bus, api, config)
            rt.spawn(binder.run(rt.stop))
            await rt.serve(make_app(binder))
    finally:
        await api.close()
    return 0
