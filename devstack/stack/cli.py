"""`gpushare up`: the whole stack locally with one command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from devstack.cluster.releases import CURRENT_VERSION, VERSION_ENV
from devstack.stack import spec
from devstack.stack.realnodes import NODES_KINDS
from devstack.stack.stack import MODE_SIMULATOR, Stack, StackConfig
from devstack.stack.terminal import guard_terminal
from shared.logging import JsonFormatter, TextFormatter, redact
from shared.settings import Settings

log = logging.getLogger("gpushare.up")


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the `up` subcommand."""
    p = subparsers.add_parser(
        "up",
        parents=[common],
        help="run everything locally: control plane, Postgres, NATS, the four services, simulated GPU nodes, a demo",
        description="Start a complete local gpushare: embedded PostgreSQL and NATS (unless GPUSHARE_DATABASE_URL / "
        f"GPUSHARE_NATS_URL name servers), a local Kubernetes {CURRENT_VERSION} control plane (another release "
        f"with {VERSION_ENV}=1.20 or =v1.N.P) whose kube-scheduler calls the "
        "extender (or the cluster in KUBECONFIG), the extender, binder, accounting, one node agent and kubelet "
        "stand-in per simulated GPU node, and a demo workload. Runs until Ctrl-C, then stops everything. Where "
        "no control plane can be had it says why and schedules the demo with a kube-scheduler simulator.",
    )
    p.add_argument("--data-dir", type=Path, default=None, help="where data and logs live (default .gpushare)")
    p.add_argument("--nodes", type=int, default=2, help="simulated GPU nodes (default 2)")
    p.add_argument(
        "--gpus", default=spec.DEFAULT_GPUS, help=f"GPUs per node, COUNTxMEM:MODEL[,...] (default {spec.DEFAULT_GPUS})"
    )
    p.add_argument(
        "--dra",
        action="store_true",
        help="make every simulated node a DRA node: its node agent publishes a ResourceSlice and serves kubelet's DRA "
        "plugin API; the extender serves gpushare admission, which rewrites the unchanged demo (in a namespace "
        "labelled gpushare.io/allocator=dra) into ResourceClaims; kube-scheduler allocates them and the ledger "
        "records them before binding (docs/dra.md; not with --simulate)",
    )
    p.add_argument(
        "--dra-nodes",
        type=int,
        default=None,
        help="make only the last N nodes DRA nodes (a mixed cluster; gpushare admission is registered, the demo's "
        "namespace stays on the device-plugin path; default: 1 with real nodes, where the DRA node runs "
        "resnet-inference of an opted-in namespace, gpushare-demo-dra, else 0)",
    )
    p.add_argument(
        "--nodes-kind",
        choices=NODES_KINDS,
        default="auto",
        help="real: each node its own kubelet, containerd and runc running the demo as real containers (root, cgroups; "
        "built once on first use, ~5 min); stand-in: kubelet stand-ins, nothing runs; auto (default): real where "
        "the machine can, else stand-ins, saying why",
    )
    p.add_argument("--no-demo", dest="demo", action="store_false", help="do not submit the demo workload")
    p.add_argument(
        "--dev-pods",
        type=int,
        default=0,
        metavar="N",
        help="also N development notebooks of 512 MiB each, the gpushare guide's 0.5 GB pods (needs --memory-unit "
        "MiB: aliyun.com/gpu-mem then counts MiB, so they ask for 512)",
    )
    p.add_argument("--simulate", action="store_true", help="skip the control plane; use the scheduler simulator")
    p.add_argument(
        "--ignore-kubeconfig", action="store_true", help="start the local control plane even when KUBECONFIG is set"
    )
    p.add_argument("--extender-port", type=int, default=12345, help="extender port (default 12345; busy: any free)")
    p.add_argument("--binder-port", type=int, default=8081, help="binder port (default 8081; busy: any free)")
    p.add_argument("--accounting-port", type=int, default=8080, help="accounting port (default 8080; busy: any free)")
    p.add_argument("--bind-timeout", type=float, default=30.0, help="extender's wait for a Binding, seconds")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas of the extender, binder and accounting (default 1; more: the extenders and accountings each "
        "behind one address, the binders electing a leader, as in docs/operations.md)",
    )
    p.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="kube-scheduler processes of the local control plane; more than one elect a leader (default 1)",
    )
    p.add_argument("--demo-timeout", type=float, default=120.0, help="how long to wait for the demo's placement")
    p.add_argument("--exit-after-demo", action="store_true", help="stop once the demo is placed (for scripts)")
    p.add_argument(
        "--usage",
        metavar="RULES",
        default=None,
        help="simulated GPU usage of the node agents (--simulate-usage rules or @FILE; default @DATA-DIR/usage.rules, "
        "written with the demo's profile when missing; edit it while the stack runs)",
    )
    p.add_argument("--no-usage", dest="simulate_usage", action="store_false", help="no simulated GPU usage")
    p.add_argument(
        "--usage-interval", type=float, default=5.0, help="seconds between the node agents' usage samples (default 5)"
    )
    p.add_argument(
        "--monitoring",
        action="store_true",
        help="also run Prometheus (Debian's package) scraping every service, and prometheus-adapter serving "
        "custom.metrics.k8s.io and external.metrics.k8s.io (the guide's aliyun_gpu_mem_usage) for "
        "HorizontalPodAutoscalers (built from its Go module on first use, ~9 min)",
    )
    p.set_defaults(func=run)


OVERUSE_GRACE_S = 20.0
"""The simulated nodes' over-use grace: short, so the demo's spikes show as over-use within a minute."""


def agent_usage(args: argparse.Namespace, data_dir: Path) -> tuple[spec.AgentUsage, str]:
    """The node agents' simulated usage, and a note when there is none (or where its rules live)."""
    from devstack.stack.demo import DEMO_USAGE_RULES
    from services.node_agent.discovery import nvidia_gpus_present

    if args.usage_interval <= 0:
        raise SystemExit("--usage-interval must be positive")
    plain = spec.AgentUsage(interval_s=args.usage_interval, overuse_grace_s=OVERUSE_GRACE_S)
    if not args.simulate_usage:
        return plain, "no simulated usage (--no-usage)"
    found = nvidia_gpus_present()
    if found:
        return plain, f"no simulated usage: this machine has NVIDIA GPUs ({found})"
    rules = args.usage
    if rules is None:
        path = data_dir.resolve() / "usage.rules"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(DEMO_USAGE_RULES)
        rules = f"@{path}"
    from services.node_agent.simulation import ProfileError, parse_rules

    if not rules.startswith("@"):
        try:
            parse_rules(rules)
        except ProfileError as exc:
            raise SystemExit(f"gpushare up: --usage: {exc}") from None
    where = f"rules in {rules[1:]}" if rules.startswith("@") else f"rules {rules!r}"
    return spec.AgentUsage(rules, args.usage_interval, OVERUSE_GRACE_S), f"simulated usage, {where}"


def monitoring_lines(stack: Stack) -> list[str]:
    """Where to look at the usage through Prometheus and the HPA metric (or why there is nothing to look at)."""
    from devstack.monitoring.adapter import external_hpa_metric, hpa_metric

    metric, lines = hpa_metric(), []
    external, selector = external_hpa_metric()
    labels = ",".join(f"{k}%3D{v}" for k, v in selector.items())
    if stack.prometheus is not None:
        lines.append(f"Prometheus: {stack.prometheus.url}/graph?g0.expr={metric}")
    if stack.adapter is not None:
        lines += [
            "HPA metric: kubectl get --raw "
            f"'/apis/custom.metrics.k8s.io/v1beta2/namespaces/gpushare-demo/pods/*/{metric}'",
            "            kubectl apply -f k8s/hpa/example-hpa.yaml; kubectl -n gpushare-demo get hpa -w",
            "The guide's External metric: kubectl get --raw "
            f"'/apis/external.metrics.k8s.io/v1beta1/namespaces/gpushare-demo/{external}?labelSelector={labels}'",
            "            kubectl apply -f k8s/hpa/guide-external-hpa.yaml (instead of example-hpa.yaml: one HPA each)",
        ]
    if stack.monitoring_error:
        lines.append(f"Monitoring: {stack.monitoring_error}")
    return lines


def config_from(args: argparse.Namespace, settings: Settings) -> StackConfig:
    """The stack configuration from flags, settings and the environment."""
    spec.parse_gpus(args.gpus)  # fail early on a bad spec
    if args.nodes < 1 or args.nodes > 64:
        raise SystemExit("--nodes must be between 1 and 64")
    if not 1 <= args.replicas <= 5 or not 1 <= args.schedulers <= 5:
        raise SystemExit("--replicas and --schedulers must be between 1 and 5")
    dra_nodes = args.nodes if args.dra else args.dra_nodes
    if dra_nodes is None:
        dra_nodes = default_dra_nodes(args)
    if not 0 <= dra_nodes <= args.nodes:
        raise SystemExit(f"--dra-nodes must be between 0 and --nodes ({args.nodes})")
    if dra_nodes and args.simulate:
        raise SystemExit("--dra needs the local control plane: the scheduler simulator has no DRA allocator")
    kubeconfig = None if args.ignore_kubeconfig or args.simulate else os.environ.get("KUBECONFIG") or None
    data_dir = args.data_dir or settings.data_dir
    usage, args.usage_note = agent_usage(args, data_dir)
    return StackConfig(
        data_dir=data_dir,
        nodes=args.nodes,
        gpus=args.gpus,
        extender_port=args.extender_port,
        binder_port=args.binder_port,
        accounting_port=args.accounting_port,
        bind_timeout=args.bind_timeout,
        replicas=args.replicas,
        schedulers=args.schedulers,
        database_url=settings.database_url.get_secret_value() if settings.database_url else None,
        nats_url=settings.nats_url,
        stream_name=settings.stream_name,
        subject_prefix=settings.subject_prefix,
        log_format=settings.log_format,
        log_level=settings.log_level,
        memory_unit=str(settings.resource_memory_unit),
        admin_token=settings.admin_token.get_secret_value() if settings.admin_token else None,
        kubeconfig=kubeconfig,
        simulate=args.simulate,
        usage=usage,
        monitoring=args.monitoring,
        admission_policies=True,  # the cluster refuses what a cluster with k8s/base refuses
        dra_nodes=dra_nodes,
        nodes_kind=args.nodes_kind,
    )


def default_dra_nodes(args: argparse.Namespace) -> int:
    """Without --dra/--dra-nodes: one DRA node beside the device-plugin ones when the nodes will be real (the
    machine can run them: the cheap checks, nothing built), else none."""
    from devstack.cluster.realnode import can_run_real_nodes

    if args.nodes < 2 or args.simulate or args.nodes_kind == "stand-in":
        return 0
    if os.environ.get("KUBECONFIG") and not args.ignore_kubeconfig:
        return 0
    return 0 if can_run_real_nodes() else 1


def nodes_line(stack: Stack) -> str:
    """What the nodes are, for the summary."""
    if stack.real_nodes:
        return f"{len(stack.real_nodes)} real node(s): kubelet, containerd, runc each ({', '.join(stack.real_nodes)})"
    if stack.nodes_kind_reason:
        return f"kubelet stand-ins (real nodes unavailable: {stack.nodes_kind_reason})"
    return "kubelet stand-ins"


LOG_FILE = "gpushare-up.log"


class TerminalFormatter(logging.Formatter):
    """What a person reads on the terminal: `WARNING: message` (secrets redacted), no JSON."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(f"{record.levelname}: {record.getMessage()}")


def configure_up_logging(log_dir: Path, level: str, fmt: str) -> Path:
    """`gpushare up`'s own logging: every record in `<log_dir>/gpushare-up.log` in `fmt` (JSON by default, as the
    services' logs beside it), warnings and errors also on the terminal as plain lines, so nothing machine-shaped
    interleaves with the progress and summary it prints. Returns the log file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / LOG_FILE
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setLevel(logging.WARNING)
    to_terminal.setFormatter(TerminalFormatter())
    root = logging.getLogger()
    root.handlers[:] = [to_file, to_terminal]
    root.setLevel(level)
    return path


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point of `gpushare up`."""
    from devstack.stack.demo import demo_deployments

    guard_terminal()  # `make run | tee log` and Ctrl-C: tee is gone before the stack has stopped
    try:
        config = config_from(args, settings)
        if args.dev_pods < 0 or args.dev_pods > 100:
            raise ValueError("--dev-pods must be between 0 and 100")
        demo_deployments(unit_mib=1 if config.memory_unit == "MiB" else 1024, dev_pods=args.dev_pods)
    except ValueError as exc:
        raise SystemExit(f"gpushare up: {exc}") from None
    configure_up_logging(Path(config.data_dir).resolve() / "logs", settings.log_level, settings.log_format)
    return asyncio.run(
        _up(
            config,
            demo=args.demo,
            demo_timeout=args.demo_timeout,
            once=args.exit_after_demo,
            note=args.usage_note,
            dev_pods=args.dev_pods,
        )
    )


async def _up(
    config: StackConfig, *, demo: bool, demo_timeout: float, once: bool, note: str = "", dev_pods: int = 0
) -> int:
    from devstack.stack.demo_run import (
        demo_container_lines,
        inspect_output,
        placement_lines,
        rightsizing_lines,
        run_demo,
        wait_for_usage,
    )

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness poll is noise here
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    stack = Stack(config)
    code = 0
    try:
        starting = asyncio.create_task(stack.start())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 130
        stopper.cancel()
        starting.result()
        if demo:
            pairs = await run_demo(stack, demo_timeout, dev_pods=dev_pods)
            print("\nDemo placement:")
            print("\n".join(placement_lines(pairs)))
            if any(not n for _, n in pairs):
                code = 1 if once else 0
            if stack.real_nodes:
                print("\nDemo containers (real ones; `kubectl -n gpushare-demo logs POD` shows the same):")
                print("\n".join(await demo_container_lines(stack, sum(1 for _, n in pairs if n))))
            if config.usage.simulate and stack.mode != MODE_SIMULATOR:
                items = await wait_for_usage(stack, sum(1 for _, n in pairs if n))
                print(f"\nRight-sizing from observed usage ({note}):")
                print("\n".join(rightsizing_lines(items)))
        if note and not (demo and config.usage.simulate and stack.mode != MODE_SIMULATOR):
            print(f"\nUsage:      {note}")
        print("\n" + (await inspect_output(stack)).rstrip())
        print(f"\nDashboard:  {stack.accounting_url}/ui")
        if stack.kubeconfig:
            print(f"kubectl:    export KUBECONFIG={stack.kubeconfig}")
            # the local accounting listens on loopback, which the API server's service proxy never reaches
            print(f"            export GPUSHARE_ACCOUNTING_URL={stack.accounting_url}")
            print("            kubectl get pods -A -o wide; kubectl inspect gpushare -d")
        if stack.mode == MODE_SIMULATOR:
            print(f"Mode:       {stack.mode} ({stack.mode_reason})")
        print(f"Nodes:      {nodes_line(stack)}")
        if config.monitoring:
            print("\n".join(monitoring_lines(stack)))
        print("\nListening:")
        print("\n".join(spec.summary_lines(stack.listens())))
        if once:
            return code
        print("\ngpushare is up. Press Ctrl-C to stop.", flush=True)
        while not stop.is_set():
            dead = stack.check_alive()
            if dead:
                for name in dead:
                    log.error("%s exited; see %s", name, stack.processes[name].log_path, extra={"service": name})
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)
        return 0
    finally:
        print("\n==> stopping everything", flush=True)
        await stack.stop()
        print("==> stopped", flush=True)
