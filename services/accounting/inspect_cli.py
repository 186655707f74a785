"""`gpushare inspect` / `kubectl-inspect-gpushare`: reads accounting's REST API and prints a layout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from shared.settings import Settings

from . import inspect_view


class AccountingUnavailable(Exception):
    """Accounting could not be reached or answered with an error; the message says which."""


def _get(client: httpx.Client, path: str) -> Any:
    try:
        response = client.get(path)
    except httpx.HTTPError as exc:
        raise AccountingUnavailable(
            f"cannot reach accounting at {client.base_url} ({exc.__class__.__name__}: {exc}); "
            "set --accounting-url or GPUSHARE_ACCOUNTING_URL"
        ) from None
    if response.status_code == 404:
        try:
            message = response.json().get("error", "not found")
        except ValueError:
            message = "not found"
        raise LookupError(message)
    if response.status_code >= 400:
        raise AccountingUnavailable(f"accounting answered {response.status_code} for {path}: {response.text[:300]}")
    return response.json()


def fetch(base_url: str, *, node: str | None, detail: bool, timeout_s: float = 10.0) -> tuple[list[dict], str]:
    """The nodes to show (with allocations when `detail` or a node is named) and the memory unit."""
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        if node:
            one = _get(client, f"/v1/nodes/{node}")
            return [one], one.get("memory_unit", "GiB")
        listing = _get(client, "/v1/nodes")
        nodes = listing["items"]
        if detail:
            nodes = [_get(client, f"/v1/nodes/{n['name']}") for n in nodes]
        return nodes, listing.get("memory_unit", "GiB")


def render(nodes: list[dict], unit: str, *, detail: bool, output: str | None) -> str:
    """The text `inspect` prints for these nodes."""
    if output == "json":
        return json.dumps({"memory_unit": unit, "nodes": nodes}, indent=2, sort_keys=True) + "\n"
    if output == "wide":
        return inspect_view.wide(nodes, unit)
    return inspect_view.details(nodes, unit) if detail else inspect_view.summary(nodes, unit)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point of `gpushare inspect`."""
    try:
        nodes, unit = fetch(settings.accounting_url, node=args.node, detail=args.details or bool(args.node))
    except AccountingUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(render(nodes, unit, detail=args.details, output=args.output))
    return 0


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the `inspect` subcommand."""
    p = subparsers.add_parser(
        "inspect",
        parents=[common],
        help="show GPU memory allocation per node (gpushare's kubectl inspect layout)",
        description="Show allocated/total GPU memory per node and GPU, read from accounting's API "
        "(--accounting-url / GPUSHARE_ACCOUNTING_URL). Same layouts as gpushare's kubectl-inspect-gpushare.",
    )
    p.add_argument("node", nargs="?", metavar="NODE", help="only this node")
    p.add_argument("-d", "--details", action="store_true", help="one row per pod, per node")
    p.add_argument("-o", "--output", choices=["json", "wide"], help="json, or wide (model, UUID, used)")
    p.set_defaults(func=run)
