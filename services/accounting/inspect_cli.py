"""`gpushare inspect` / `kubectl inspect gpushare`: gpushare's layouts of GPU memory per node and GPU.

Reads accounting (directly, or through the API server's service proxy with the user's kubeconfig), or the API
server alone when accounting cannot be reached: see `inspect_source` for the order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from typing import Any

from shared.settings import Settings

from . import inspect_source, inspect_view
from .inspect_source import NAMESPACE, NotFound, Request, Unavailable

DESCRIPTION = (
    "Show allocated/total GPU memory per node and GPU, in gpushare's kubectl-inspect-gpushare layouts. "
    f"Reads accounting through the API server's service proxy ({NAMESPACE}/{inspect_source.SERVICE}, port "
    f"`{inspect_source.PORT_NAME}`) with your kubeconfig, like any kubectl plugin; when accounting cannot be "
    "reached, what the API server alone shows (node capacity and gpushare pod annotations), and says so. "
    "--accounting-url / GPUSHARE_ACCOUNTING_URL, when set, is read instead. Without any Kubernetes "
    "configuration: accounting at http://127.0.0.1:8080."
)


def render(nodes: list[dict], unit: str, *, detail: bool, output: str | None, source: str = "accounting") -> str:
    """The text `inspect` prints for these nodes."""
    if output == "json":
        body = {"memory_unit": unit, "nodes": nodes, "source": source}
        return json.dumps(body, indent=2, sort_keys=True) + "\n"
    if output == "wide":
        return inspect_view.wide(nodes, unit)
    return inspect_view.details(nodes, unit) if detail else inspect_view.summary(nodes, unit)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point of `gpushare inspect` and `kubectl inspect gpushare`."""
    request = Request(
        node=args.node,
        detail=args.details or bool(args.node),
        kubeconfig=args.kubeconfig,
        context=args.context,
        namespace=args.namespace,
        timeout_s=args.request_timeout,
    )
    if settings.log_level != "DEBUG":  # a user's command: no line per HTTP request on stderr
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        reading = asyncio.run(inspect_source.read(settings, request))
    except Unavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if reading.note:
        print(f"note: {reading.note}", file=sys.stderr)
    sys.stdout.write(
        render(reading.nodes, reading.unit, detail=args.details, output=args.output, source=reading.source)
    )
    return 0


NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _node(text: str) -> str:
    if len(text) > 253 or not NODE_NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Kubernetes node name")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 600:
        raise argparse.ArgumentTypeError(f"{text!r}: between 0 and 600 seconds")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `inspect` (also those of the kubectl plugin)."""
    p.add_argument("node", nargs="?", metavar="NODE", type=_node, help="only this node")
    p.add_argument("-d", "--details", action="store_true", help="one row per pod, per node")
    p.add_argument("-o", "--output", choices=["json", "wide"], help="json, or wide (model, UUID, used)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    p.add_argument("--context", help="the kubeconfig context to use (default: its current context)")
    p.add_argument(
        "-n", "--namespace", default=NAMESPACE, help=f"the namespace gpushare is installed in (default {NAMESPACE})"
    )
    p.add_argument("--request-timeout", type=_seconds, default=10.0, metavar="SECONDS", help="per request (default 10)")
    p.set_defaults(func=run)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the `inspect` subcommand."""
    p = subparsers.add_parser(
        "inspect",
        parents=[common],
        help="show GPU memory allocation per node (gpushare's kubectl inspect layout)",
        description=DESCRIPTION,
    )
    add_arguments(p)


def plugin_parser(common: argparse.ArgumentParser, version: str) -> argparse.ArgumentParser:
    """The command line of `kubectl inspect gpushare` (the `kubectl-inspect-gpushare` executable)."""
    p = argparse.ArgumentParser(prog="kubectl inspect gpushare", parents=[common], description=DESCRIPTION)
    p.add_argument("--version", action="version", version=version)
    add_arguments(p)
    return p
