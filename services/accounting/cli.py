"""`gpushare accounting` (the service) and `gpushare inspect` (its command-line client)."""

from __future__ import annotations

import argparse
from typing import Any

from shared.settings import ACCOUNTING_PORT, Settings

from . import inspect_cli


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point of `gpushare accounting`."""
    from shared.runtime import run_main

    from .service import serve

    run_main(serve(settings, host=args.host, port=args.port, kubernetes=args.kubernetes, kubeconfig=args.kubeconfig))
    return 0


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the `accounting` and `inspect` subcommands."""
    p = subparsers.add_parser(
        "accounting",
        parents=[common],
        help="run accounting: projections, REST API (/v1, /docs), dashboard (/ui), metrics",
        description="Consume every event into read models and serve the REST API under /v1 (OpenAPI at /docs), "
        "the dashboard at /ui and Prometheus metrics at /metrics. Quota writes need "
        "GPUSHARE_ADMIN_TOKEN as a bearer token.",
    )
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=ACCOUNTING_PORT, help=f"listen port (default {ACCOUNTING_PORT})")
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig for the API server: ResourceQuotas on gpushare's resources, ReplicaSets' owners, the pod "
        "watch behind scheduling waits (default: $KUBECONFIG, in-cluster)",
    )
    p.add_argument(
        "--no-kubernetes",
        dest="kubernetes",
        action="store_false",
        help="no API server: /v1/quotas shows the ledger's quotas only, workloads are named from ReplicaSet names, "
        "scheduling waits are not measured",
    )
    p.set_defaults(func=run)
    inspect_cli.register(subparsers, common)
