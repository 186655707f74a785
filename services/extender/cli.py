"""`gpushare extender`: the kube-scheduler extender (filter, prioritize, bind, preempt)."""

from __future__ import annotations

import argparse

from services.extender.wire import DEFAULT_PREFIX
from shared.placement import Policy
from shared.settings import Settings


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the `extender` subcommand."""
    p = subparsers.add_parser(
        "extender",
        parents=[common],
        help="run the kube-scheduler extender (filter, prioritize, bind, preempt)",
        description="Serve kube-scheduler's extender verbs. Placement decisions read an in-memory view of the "
        "ledger; each bind reserves GPUs in the ledger (authoritative) and waits for the binder's outcome.",
    )
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=12345, help="listen port (default 12345)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"URL prefix of the verbs (default {DEFAULT_PREFIX})")
    p.add_argument(
        "--bind-timeout", type=float, default=20.0, help="seconds to wait for the binder's outcome (default 20)"
    )
    p.add_argument(
        "--policy", choices=[x.value for x in Policy], default="binpack", help="default placement policy (binpack)"
    )
    p.add_argument("--resync", type=float, default=30.0, help="seconds between full reloads from the ledger (30)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for reading pods bind has not seen (optional)")
    p.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (for enableHTTPS)")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    p.set_defaults(func=run)


async def _serve(args: argparse.Namespace, settings: Settings) -> None:
    from services.extender.app import create_app
    from services.extender.service import ExtenderService
    from shared.runtime import Listen, ServiceRuntime

    listen = Listen(args.host, args.port, args.tls_cert, args.tls_key)
    # kube-scheduler binds many pods at once and each bind holds a connection for its reservation; connections
    # beyond the pool are closed after use, and opening one costs more than the reservation itself
    async with ServiceRuntime("extender", settings, pool_size=6, listen=listen) as rt:
        assert rt.engine is not None and rt.ledger is not None
        service = ExtenderService(
            engine=rt.engine,
            ledger=rt.ledger,
            bus=rt.bus,
            unit=settings.resource_memory_unit,
            policy=Policy(args.policy),
            bind_timeout_s=args.bind_timeout,
            resync_s=args.resync,
            kubeconfig=args.kubeconfig,
        )
        await service.start()
        try:
            await rt.serve(create_app(service, prefix=args.prefix))
        finally:
            await service.close()


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run the extender until SIGTERM / SIGINT."""
    if args.bind_timeout <= 0 or args.resync <= 0:
        raise SystemExit("--bind-timeout and --resync must be positive")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    from shared.runtime import run_main

    run_main(_serve(args, settings))
    return 0
