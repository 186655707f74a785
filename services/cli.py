"""`gpushare`: one command with a subcommand per service and tool.

Every subcommand takes the common flags below; each flag can also be given as a `GPUSHARE_*`
environment variable (flags win). Services register their own subcommands in `services/<name>/cli.py`
(a `register(subparsers, common)` function), so this module stays a thin dispatcher.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from importlib import metadata

from shared.logging import configure_logging
from shared.optional import optional_module
from shared.placeholders import refuse_placeholders
from shared.settings import DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX, Settings

log = logging.getLogger("gpushare")

SERVICE_CLIS = (
    "services.scheduler_config",
    "services.extender.cli",
    "services.binder.cli",
    "services.accounting.cli",
    "services.node_agent.cli",
    "devstack.stack.cli",
)
"""Modules that register subcommands (`register(subparsers, common)`); one that is not installed (the local-stack
tooling in an image) is left out."""

COMMON_FLAGS = {
    "database_url": "PostgreSQL URL; for failover several hosts, postgresql://USER@h1:5432,h2:5432/DB"
    "?target_session_attrs=read-write (GPUSHARE_DATABASE_URL)",
    "nats_url": "NATS URL; a cluster's servers comma-separated (GPUSHARE_NATS_URL)",
    "accounting_url": "accounting's base URL (GPUSHARE_ACCOUNTING_URL)",
    "log_level": "DEBUG, INFO, WARNING, ERROR (GPUSHARE_LOG_LEVEL, default INFO)",
    "log_format": "json or text (GPUSHARE_LOG_FORMAT, default json)",
    "resource_memory_unit": "GiB or MiB: unit of aliyun.com/gpu-mem (GPUSHARE_RESOURCE_MEMORY_UNIT)",
    "stream_name": f"JetStream stream name (GPUSHARE_STREAM_NAME, default {DEFAULT_STREAM})",
    "subject_prefix": f"event subject prefix (GPUSHARE_SUBJECT_PREFIX, default {DEFAULT_SUBJECT_PREFIX})",
}


INSPECT_CLI = "services.accounting.inspect_cli"  # the module behind `kubectl inspect gpushare`


def version(*, schema: bool = True) -> str:
    """`gpushare <version> (ledger schema <revision>)`: the installed release and, with `schema`, the ledger
    schema revision it needs (reading the migrations takes ~0.2 s: only when asked)."""
    try:
        release = metadata.version("gpushare")
    except metadata.PackageNotFoundError:
        release = "(version unknown: not installed as a distribution)"
    if not schema:
        return f"gpushare {release}"
    from shared.ledger.migrate import head_revision

    return f"gpushare {release} (ledger schema {head_revision()})"


class _VersionAction(argparse.Action):
    """`--version`: the release and the schema revision, worked out only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=str(kwargs.get("help")))

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version())
        parser.exit()


INSPECT_FLAGS = ("accounting_url", "log_level", "log_format", "resource_memory_unit")
"""The common flags `kubectl inspect gpushare` takes (it needs no database or bus)."""


def common_parser(names: tuple[str, ...] = tuple(COMMON_FLAGS)) -> argparse.ArgumentParser:
    """The flags every subcommand accepts (`names`: only these)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("common settings")
    for name in names:
        help_text = COMMON_FLAGS[name]
        flag = "--" + name.replace("_", "-")
        if name == "resource_memory_unit":
            group.add_argument(flag, "--memory-unit", dest=name, default=None, choices=["GiB", "MiB"], help=help_text)
        else:
            group.add_argument(flag, dest=name, default=None, help=help_text)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by any common flag given."""
    overrides = {k: getattr(args, k) for k in COMMON_FLAGS if getattr(args, k, None) is not None}
    return Settings(**overrides)


def _cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from shared.ledger import migrate, roles

    url = settings.require_database_url()
    passwords = roles.passwords_from_env()
    by_setting = {roles.PASSWORD_ENV.format(r.removeprefix("gpushare_").upper()): pw for r, pw in passwords.items()}
    refuse_placeholders(settings, by_setting)
    if args.downgrade:
        migrate.downgrade(url, args.downgrade)
        log.info("downgraded the ledger schema", extra={"revision": args.downgrade})
        return 0
    migrate.upgrade(url, args.revision)
    log.info("ledger schema is at %s", args.revision, extra={"revision": migrate.head_revision()})
    if passwords:
        asyncio.run(roles.set_passwords(url, passwords))
        log.info("set the passwords of the service roles", extra={"roles": sorted(passwords)})
    return 0


def _seconds(text: str) -> float:
    """A command-line duration in seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of seconds is 0 or more, not {text}")
    return value


def _cmd_ledger(args: argparse.Namespace, settings: Settings) -> int:
    from services.ledger_tool import rebuild

    return asyncio.run(
        rebuild(
            settings,
            apply=args.apply,
            verify=not args.apply or args.verify,
            from_start=args.from_start,
            wait_s=args.wait,
        )
    )


def _cmd_snapshot(args: argparse.Namespace, settings: Settings) -> int:
    from services.ledger_tool import snapshot

    return asyncio.run(snapshot(settings, from_database=args.from_database, trim=not args.no_trim))


def build_parser() -> argparse.ArgumentParser:
    """The whole `gpushare` command line."""
    common = common_parser()
    parser = argparse.ArgumentParser(
        prog="gpushare",
        description="GPU sharing for Kubernetes: scheduler extender, binder, node agent, accounting.",
    )
    parser.add_argument("--version", action=_VersionAction, help="show the release and its ledger schema revision")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "migrate",
        parents=[common],
        help="upgrade the ledger schema (or --downgrade base)",
        description="Apply the ledger's database migrations.",
    )
    p.add_argument("--revision", default="head", help="target revision (default head)")
    p.epilog = (
        "After upgrading, the services' roles (gpushare_extender, gpushare_binder, gpushare_accounting) get the "
        "passwords in GPUSHARE_DB_PASSWORD_EXTENDER / _BINDER / _ACCOUNTING, for those that are set."
    )
    p.add_argument("--downgrade", metavar="REVISION", help="downgrade to REVISION instead (base = empty)")
    p.set_defaults(func=_cmd_migrate)

    p = sub.add_parser(
        "ledger",
        parents=[common],
        help="ledger maintenance (rebuild from the event stream, snapshots)",
        description="Ledger maintenance.",
    )
    lsub = p.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)
    r = lsub.add_parser(
        "rebuild",
        parents=[common],
        help="replay the event stream into the ledger",
        description="Start from the newest ledger snapshot and replay the ledger stream's events after it. By "
        "default compare the result with the live ledger and rebuild accounting's projections; with --apply "
        "also replace the ledger tables with the replayed state (disaster recovery). Exit 1: the ledgers "
        "differ; exit 3: the stream lost events no snapshot covers; exit 4: NATS or PostgreSQL did not answer "
        "within --wait.",
    )
    r.add_argument("--apply", action="store_true", help="replace the ledger tables with the replayed state")
    r.add_argument("--verify", action="store_true", help="with --apply, compare before replacing")
    r.add_argument(
        "--from-start", action="store_true", help="ignore snapshots and replay from the stream's first event"
    )
    r.add_argument(
        "--wait",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="wait this long for NATS and PostgreSQL while they do not answer, or while a stream or the snapshot "
        "store elects a leader after a server was lost (default 60)",
    )
    r.set_defaults(func=_cmd_ledger)
    r = lsub.add_parser(
        "snapshot",
        parents=[common],
        help="fold the ledger stream into a snapshot and trim what it covers",
        description="Fold the newest ledger snapshot and the ledger stream's events after it into a new "
        "snapshot, store it in the JetStream object store <stream>_SNAPSHOTS (keeping GPUSHARE_SNAPSHOT_KEEP), "
        "and purge the stream's events it covers that every durable consumer has read. Accounting does this "
        "every GPUSHARE_SNAPSHOT_INTERVAL. Exit 3: the stream lost events no snapshot covers (see --from-database).",
    )
    r.add_argument(
        "--from-database",
        action="store_true",
        help="take the live ledger tables as the new base (after exit 3, or to start without the stream's history)",
    )
    r.add_argument("--no-trim", action="store_true", help="write the snapshot but leave the stream as it is")
    r.set_defaults(func=_cmd_snapshot)

    for module_name in SERVICE_CLIS:
        module = optional_module(module_name)
        if module is not None:
            module.register(sub, common)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Entry point of the `gpushare` console script (`parser`: another command line than `gpushare`'s)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args)
    except Exception as exc:
        parser.error(f"invalid setting: {exc}")
    configure_logging(settings.log_level, settings.log_format)
    if getattr(args, "command", None) != "migrate":  # migrate checks its role passwords too (plugin: no command)
        refuse_placeholders(settings)
    func: Callable[[argparse.Namespace, Settings], int] = args.func
    try:
        return int(func(args, settings) or 0)
    except KeyboardInterrupt:
        return 130


def inspect_main(argv: list[str] | None = None) -> int:
    """Entry point of `kubectl-inspect-gpushare`: `gpushare inspect` under kubectl's name for it."""
    module = optional_module(INSPECT_CLI)
    if module is None:
        print("error: this installation has no `inspect` (services.accounting is missing)", file=sys.stderr)
        return 2
    parser = module.plugin_parser(common_parser(INSPECT_FLAGS), version(schema=False))
    return main(sys.argv[1:] if argv is None else argv, parser)


if __name__ == "__main__":
    sys.exit(main())
