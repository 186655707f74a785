"""`gpushare extender`: the kube-scheduler extender (filter, prioritize, bind, preempt)."""

from __future__ import annotations

import argparse
import logging

from services.extender.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREFIX
from shared.placeholders import PLACEHOLDER
from shared.placement import Policy
from shared.settings import Settings

log = logging.getLogger(__name__)


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
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig for reading the pod bind reserves for (default: $KUBECONFIG, else in-cluster)",
    )
    p.add_argument(
        "--trust-filter-pods",
        action="store_true",
        help="DEVELOPMENT ONLY: bind reserves for the pod a filter call described, unverified, and never asks the "
        "Kubernetes API (for runs without an API server); anyone who can call filter can then steer reservations",
    )
    p.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (for enableHTTPS)")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        help="mutual TLS: serve only clients presenting a certificate signed by this CA (kube-scheduler's "
        "tlsConfig certFile/keyFile); needs --tls-cert",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve /healthz, /readyz and /metrics (nothing else) over plain HTTP on this port, for probes and "
        "Prometheus when --tls-client-ca is set",
    )
    p.add_argument(
        "--webhook-port",
        type=int,
        default=None,
        help="also serve gpushare admission (POST /mutate: the mutating webhook that rewrites aliyun.com/* pods of "
        "opted-in namespaces into DRA claims; POST /validate-claims: the validating webhook that counts gpushare "
        "ResourceClaims against their namespace's GPU quota; docs/dra.md) over HTTPS on this port; needs "
        "--webhook-tls-cert/-key",
    )
    p.add_argument("--webhook-tls-cert", default=None, help="serving certificate of --webhook-port")
    p.add_argument("--webhook-tls-key", default=None, help="private key of --webhook-tls-cert")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES}: above kube-scheduler's largest body at 5,000 "
        "nodes with nodeCacheCapable: true; Node lists of nodeCacheCapable: false need far more)",
    )
    p.set_defaults(func=run)


async def _serve(args: argparse.Namespace, settings: Settings) -> None:
    from prometheus_client import REGISTRY

    from services.extender.admission import Admission, create_webhook_app
    from services.extender.app import create_app, create_health_app
    from services.extender.claim_admission import ClaimAdmission
    from services.extender.service import ExtenderService
    from shared.runtime import Listen, ServiceRuntime

    listen = Listen(args.host, args.port, args.tls_cert, args.tls_key, args.tls_client_ca)
    probes = Listen(args.host, args.health_port) if args.health_port else None
    webhook = (
        (Listen(args.host, args.webhook_port, args.webhook_tls_cert, args.webhook_tls_key),)
        if args.webhook_port
        else ()
    )
    # kube-scheduler binds many pods at once and each bind holds a connection for its reservation; connections
    # beyond the pool are closed after use, and opening one costs more than the reservation itself
    async with ServiceRuntime("extender", settings, pool_size=6, listen=listen, probes=probes, extra=webhook) as rt:
        assert rt.engine is not None and rt.ledger is not None
        REGISTRY.register(rt.ledger_metrics())  # the extender's metrics are the process's
        service = ExtenderService(
            engine=rt.engine,
            ledger=rt.ledger,
            bus=rt.bus,
            unit=settings.resource_memory_unit,
            policy=Policy(args.policy),
            bind_timeout_s=args.bind_timeout,
            resync_s=args.resync,
            kubeconfig=args.kubeconfig,
            kube_enabled=not args.trust_filter_pods,
        )
        await service.start()
        admission = Admission(settings.resource_memory_unit, kubeconfig=args.kubeconfig)
        claims = ClaimAdmission(
            rt.engine, settings.resource_memory_unit, bus=rt.bus, has_quota=lambda ns: ns in service.view.quotas
        )
        try:
            await rt.serve(
                create_app(service, prefix=args.prefix, max_body_bytes=args.max_body_bytes),
                probes_app=create_health_app(service) if args.health_port else None,
                extra_apps=(create_webhook_app(admission, claims=claims, ready=lambda: service.ready),)
                if webhook
                else (),
            )
        finally:
            await admission.close()
            await service.close()


def _check_pem(flag: str, path: str) -> None:
    """SystemExit naming the problem when a certificate or key file cannot be used (unreadable, the shipped
    placeholder of k8s/overlays/dra/tls, not PEM)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(4096)
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if text.lstrip().lower().startswith(PLACEHOLDER):
        raise SystemExit(
            f"{flag} {path} is the shipped placeholder: run k8s/generate-webhook-cert.sh (or give a certificate of "
            "your own) and apply k8s/overlays/dra again"
        )
    if "-----BEGIN " not in text:
        raise SystemExit(f"{flag} {path} is not a PEM file (-----BEGIN ...)")


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run the extender until SIGTERM / SIGINT."""
    if args.bind_timeout <= 0 or args.resync <= 0:
        raise SystemExit("--bind-timeout and --resync must be positive")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    if args.max_body_bytes < 64 * 1024:
        raise SystemExit("--max-body-bytes must be at least 65536")
    if args.health_port is not None and args.health_port == args.port:
        raise SystemExit("--health-port must differ from --port")
    if args.webhook_port is not None:
        if not (args.webhook_tls_cert and args.webhook_tls_key):
            raise SystemExit(
                "--webhook-port needs --webhook-tls-cert and --webhook-tls-key (kube-apiserver calls "
                "webhooks over HTTPS only)"
            )
        if args.webhook_port in (args.port, args.health_port):
            raise SystemExit("--webhook-port must differ from --port and --health-port")
        for flag, path in (("--webhook-tls-cert", args.webhook_tls_cert), ("--webhook-tls-key", args.webhook_tls_key)):
            _check_pem(flag, path)
        if args.trust_filter_pods:
            raise SystemExit(
                "--webhook-port needs the Kubernetes API (it creates ResourceClaimTemplates): "
                "not with --trust-filter-pods"
            )
    elif args.webhook_tls_cert or args.webhook_tls_key:
        raise SystemExit("--webhook-tls-cert/--webhook-tls-key go with --webhook-port")
    if args.trust_filter_pods:
        log.warning(
            "--trust-filter-pods: bind reserves for pods as filter calls describe them, without asking the Kubernetes "
            "API; anyone who can reach the extender can steer reservations (development only)"
        )
    from shared.runtime import run_main

    run_main(_serve(args, settings))
    return 0
