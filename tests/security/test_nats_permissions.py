"""The shipped NATS users (k8s/base/nats-auth.conf) on a real nats-server: each service's user does its job with the
service's own code, and is refused what it must not do (the server names the refused subject).

The server runs with the file exactly as shipped (the k8s and docker-compose configurations include it), on the
default stream GPUSHARE and prefix gpushare, with passwords from its environment as in the manifests.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.errors import Error as NatsError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import EmbeddedNats
from services.binder.gateway import LedgerGateway
from services.binder.metrics import BinderMetrics
from services.node_agent.ledger_link import LedgerLink
from shared.events.auth import NatsAuth
from shared.events.bus import BusNames, EventBus
from shared.events.catalogue import (
    AllocationPart,
    Event,
    GpuInfo,
    InventoryEvent,
    QuotaEvent,
    RefusedEvent,
    ReservedEvent,
    UnallocatedUseEvent,
    UsageEvent,
    UsageSample,
    encode_event,
    subject_for,
)
from shared.events.consumer import DurableConsumer
from shared.ledger.ledger import Ledger
from shared.ledger.models import nodes
from shared.ledger.outbox import OutboxRelay
from shared.ledger.snapshots import SnapshotStore, take_snapshot
from tests.reliability.harness import REPO
from tests.waiting import eventually

AUTH_CONF = REPO / "k8s" / "base" / "nats-auth.conf"
NAMES = BusNames()  # GPUSHARE / gpushare, as the file is written
USERS = ("extender", "binder", "accounting", "node-agent", "admin")
PASSWORDS = {user: f"pw-{user}-{uuid.uuid4().hex}" for user in USERS}


def password_env() -> dict[str, str]:
    """The server's environment: GPUSHARE_NATS_<USER>_PASSWORD, as the manifests give it from the Secret."""
    return {f"GPUSHARE_NATS_{u.upper().replace('-', '_')}_PASSWORD": pw for u, pw in PASSWORDS.items()}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A nats-server with JetStream and the shipped users."""
    data = Path(tempfile.mkdtemp(prefix="gpushare-nats-auth-"))
    config = data / "nats.conf"
    shutil.copy(AUTH_CONF, data / AUTH_CONF.name)  # byte for byte; NATS includes relative to the including file
    config.write_text(f"include {AUTH_CONF.name}\n")
    nats_server = EmbeddedNats(data, config=config, env=password_env())
    try:
        yield nats_server.start()
    finally:
        nats_server.stop()
        shutil.rmtree(data, ignore_errors=True)


def auth(user: str) -> NatsAuth:
    return NatsAuth(user=f"gpushare-{user}", password=PASSWORDS[user])


@pytest.fixture
async def connect(server: str) -> AsyncIterator:
    """connect(user) -> an EventBus logged in as that service (closed afterwards)."""
    opened: list[EventBus] = []

    async def _connect(user: str) -> EventBus:
        bus = await EventBus.connect(server, NAMES, name=f"test-{user}", auth=auth(user))
        opened.append(bus)
        return bus

    yield _connect
    for bus in opened:
        await bus.close()


@pytest.fixture(autouse=True)
async def fresh_streams(server: str) -> AsyncIterator[None]:
    """Each test starts without the streams (deleted by the admin user afterwards)."""
    yield
    admin = await EventBus.connect(server, NAMES, name="test-admin", auth=auth("admin"))
    await admin.delete_streams()
    await admin.close()


async def refused(caplog: pytest.LogCaptureFixture, what: str, subject: str) -> None:
    """The server reported a permissions violation for `what` (Publish / Subscription) to `subject`."""
    needle = f'permissions violation for {what} to "{subject}"'.lower()
    await eventually(lambda: needle in caplog.text.lower(), what=f"the server refusing: {needle}", within=10)


async def stored(bus: EventBus, subject: str) -> int:
    """How many messages the stream of the subject's kind (ledger or samples) holds on `subject`."""
    info = await bus.js.stream_info(NAMES.stream_of(subject.split(".")[1]), subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def ignore(msg: object) -> None:
    """A subscription callback that does nothing."""


def reserved(node: str = "n1") -> ReservedEvent:
    part = AllocationPart(container="main", container_index=0, gpu_uuid=f"GPU-{node}-0", gpu_index=0, memory_mib=1024)
    return ReservedEvent(
        allocation_id=uuid.uuid4(), pod_uid="uid-1", namespace="ns", pod_name="p", node=node, parts=[part]
    )


def inventory(node: str = "n1") -> InventoryEvent:
    gpu = GpuInfo(uuid=f"GPU-{node}-0", index=0, model="T4", memory_mib=15360, memory_total_mib=15360)
    return InventoryEvent(node=node, gpus=[gpu])


async def publish_refused(bus: EventBus, event: Event) -> bool:
    """Publish through JetStream; True when no acknowledgement comes (the server dropped it)."""
    try:
        await bus.js.publish(subject_for(NAMES.prefix, event), encode_event(event), timeout=1)
    except (TimeoutError, NatsError):
        return True
    return False


async def test_no_user_and_a_wrong_password_are_turned_away(server: str) -> None:
    for options in ({}, {"user": "gpushare-binder", "password": "wrong"}):
        with pytest.raises(NatsError):
            await nats.connect(server, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0, **options)


async def test_node_agent_talks_to_the_gateway_follows_its_node_and_publishes_usage(
    connect, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="shared.events.bus")
    binder = await connect("binder")  # creates the streams
    stop = asyncio.Event()
    relay = OutboxRelay(engine, binder, poll_s=0.1)
    ledger = Ledger(engine, prefix=NAMES.prefix, source="binder", on_commit=relay.kick)
    gateway = LedgerGateway(ledger, binder, metrics=BinderMetrics())
    tasks = [asyncio.create_task(relay.run(stop)), asyncio.create_task(gateway.run(stop))]
    try:
        await gateway.ready.wait()
        agent = await connect("node-agent")  # the streams exist: looking them up is allowed
        link = LedgerLink(agent, "n1")
        reply = await link.send(inventory("n1"), deadline_s=10)
        assert reply.ok, reply
        async with engine.connect() as conn:
            assert (await conn.execute(select(nodes.c.name))).scalars().all() == ["n1"]
        seen: list[Event] = []
        snapshot = await link.snapshot(deadline_s=10)
        await link.follow(0, seen.append)  # the node's events from the start: the relayed inventory
        await eventually(lambda: any(isinstance(e, InventoryEvent) for e in seen), what="the node's own events")
        assert snapshot.node == "n1"
        usage = UsageEvent(node="n1", samples=[UsageSample(gpu_uuid="GPU-n1-0", used_memory_mib=10)])
        await agent.publish(usage)
        assert await stored(binder, "gpushare.usage.n1") == 1
        flagged = UnallocatedUseEvent(node="n1", gpu_uuid="GPU-n1-0", pod_uid="uid-9", used_memory_mib=5)
        await agent.publish(flagged)
        assert await stored(binder, "gpushare.unallocated.n1") == 1
        await link.unfollow()

        # refused: forging a ledger event, answering other agents' requests, reading other services' replies,
        # consuming the stream durably or deleting it
        assert await publish_refused(agent, reserved("n1"))
        await refused(caplog, "Publish", "gpushare.reserved.n1")
        assert await stored(binder, "gpushare.reserved.>") == 0
        await agent.nc.subscribe("gpushare-rpc.>", cb=ignore)
        await refused(caplog, "Subscription", "gpushare-rpc.>")
        await agent.nc.subscribe("_INBOX.gpushare-binder.>", cb=ignore)
        await refused(caplog, "Subscription", "_INBOX.gpushare-binder.>")
        with pytest.raises((TimeoutError, NatsError)):
            await agent.js.delete_stream(NAMES.stream)
        await refused(caplog, "Publish", f"$JS.API.STREAM.DELETE.{NAMES.stream}")
        await agent.nc.publish("gpushare-parked.binder", b"x")
        await refused(caplog, "Publish", "gpushare-parked.binder")
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_node_agent_cannot_create_the_streams(connect, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shared.events.bus")
    with pytest.raises((TimeoutError, NatsError)):
        await asyncio.wait_for(connect("node-agent"), 15)
    await refused(caplog, "Publish", f"$JS.API.STREAM.CREATE.{NAMES.stream}")


async def test_binder_and_accounting_consume_durably_and_park(connect, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shared.events.bus")
    extender = await connect("extender")
    for user in ("binder", "accounting"):
        bus = await connect(user)
        got: list[Event] = []

        async def handle(event: Event, got: list[Event] = got) -> None:
            got.append(event)

        consumer = DurableConsumer(bus, f"perm-{user}", handle, kinds=["reserved"])
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        await extender.publish(reserved(f"{user}-node"))
        mine = f"{user}-node"
        await eventually(
            lambda got=got, mine=mine: any(getattr(e, "node", "") == mine for e in got),
            what=f"{user}'s durable consumer receiving an event",
        )
        await bus.js.publish(f"{NAMES.parked_prefix}.perm-{user}", b"parked", timeout=5)  # parking
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.nc.subscribe("_INBOX.gpushare-node-agent.>", cb=ignore)
        await refused(caplog, "Subscription", "_INBOX.gpushare-node-agent.>")
        with pytest.raises((TimeoutError, NatsError)):
            await bus.js.delete_stream(NAMES.stream)
        await refused(caplog, "Publish", f"$JS.API.STREAM.DELETE.{NAMES.stream}")
    accounting = await connect("accounting")
    await accounting.publish(QuotaEvent(namespace="team", memory_mib=1024))
    assert await stored(accounting, "gpushare.quota.>") == 1
    await accounting.nc.subscribe("gpushare-rpc.>", cb=ignore)  # impersonating the gateway
    await refused(caplog, "Subscription", "gpushare-rpc.>")
    await accounting.nc.publish("gpushare-rpc.command.n1", b"{}")  # impersonating an agent
    await refused(caplog, "Publish", "gpushare-rpc.command.n1")


async def test_extender_publishes_reads_every_event_and_nothing_more(connect, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shared.events.bus")
    extender = await connect("extender")
    seen: list[str] = []

    async def on_msg(msg: object) -> None:
        seen.append(msg.subject)  # type: ignore[attr-defined]

    await extender.nc.subscribe(f"{NAMES.prefix}.>", cb=on_msg)  # its view's core subscription
    await extender.publish(reserved("n2"))
    await extender.publish(RefusedEvent(pod_uid="u", namespace="ns", pod_name="p", summary="full"))
    await eventually(lambda: "gpushare.reserved.n2" in seen, what="the extender seeing its own event")
    await extender.nc.subscribe("gpushare-rpc.>", cb=ignore)
    await refused(caplog, "Subscription", "gpushare-rpc.>")
    with pytest.raises((TimeoutError, NatsError)):  # no durable consumers for the extender
        await extender.js.pull_subscribe("gpushare.>", durable="sneaky", stream=NAMES.stream)
    await refused(caplog, "Publish", f"$JS.API.CONSUMER.INFO.{NAMES.stream}.sneaky")


async def _answers(server: EmbeddedNats, url: str, auth: NatsAuth) -> bool:
    bus = await asyncio.wait_for(EventBus.connect(url, BusNames(), name="test-credentials", auth=auth), 15)
    try:
        await bus.publish(QuotaEvent(namespace="x", memory_mib=1))  # a JetStream round trip
        return True
    finally:
        await bus.delete_streams()
        await bus.close()


async def _admission(tmp_path: Path, auth: NatsAuth) -> tuple[bool, bool]:
    """A nats-server with `tmp_path/nats.conf`: (it answers a bus logged in with `auth`, it refuses a bare client)."""
    server = EmbeddedNats(tmp_path / "data", config=tmp_path / "nats.conf")
    url = server.start()
    try:
        answers = await _answers(server, url, auth)
        try:
            bare = await nats.connect(url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
        except NatsError:
            return answers, True
        await bare.close()
        return answers, False
    finally:
        server.stop()


async def test_event_bus_logs_in_with_an_nkey_seed(tmp_path: Path) -> None:
    import os

    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    (tmp_path / "nats.conf").write_text(f"authorization {{ users: [ {{ nkey: {public} }} ] }}\n")
    assert await _admission(tmp_path, NatsAuth(nkey_seed_file=seed_file)) == (True, True)  # admitted; bare refused


async def test_event_bus_presents_a_tls_client_certificate(tmp_path: Path) -> None:
    from tests.extender.test_mtls import make_ca, make_cert

    ca = make_ca(tmp_path, "nats-ca")
    server_cert = make_cert(tmp_path, "nats-server", ca, server=True)
    client_cert = make_cert(tmp_path, "gpushare-binder", ca, server=False)
    (tmp_path / "nats.conf").write_text(
        f'tls {{ cert_file: "{server_cert[0]}", key_file: "{server_cert[1]}", ca_file: "{ca[0]}", verify: true }}\n'
    )
    server = EmbeddedNats(tmp_path / "data", config=tmp_path / "nats.conf")
    url = server.start().replace("nats://", "tls://")
    try:
        good = NatsAuth(tls_cert=client_cert[0], tls_key=client_cert[1], tls_ca=ca[0])
        assert await _answers(server, url, good)
        trusts_the_server = ssl.create_default_context(cafile=str(ca[0]))  # but presents no certificate
        with pytest.raises((NatsError, OSError, TimeoutError)):
            await asyncio.wait_for(
                nats.connect(
                    url, tls=trusts_the_server, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0
                ),
                10,
            )
    finally:
        server.stop()


def test_credentials_are_checked_before_connecting(tmp_path: Path) -> None:
    from shared.events.auth import NatsAuthError

    with pytest.raises(NatsAuthError, match="GPUSHARE_NATS_CREDS"):
        NatsAuth(creds_file=tmp_path / "missing.creds").options()
    with pytest.raises(NatsAuthError, match="go together"):
        NatsAuth(tls_cert=tmp_path / "c.crt").options()
    with pytest.raises(NatsAuthError, match="GPUSHARE_NATS_USER"):
        NatsAuth(password="pw").options("nats://nats:4222")
    assert NatsAuth(password="pw").options("nats://binder:x@nats:4222")["password"] == "pw"
    assert NatsAuth(user="gpushare-binder").options()["inbox_prefix"] == "_INBOX.gpushare-binder"
    assert NatsAuth().options("nats://gpushare-binder:pw@nats:4222")["inbox_prefix"] == "_INBOX.gpushare-binder"
    assert "inbox_prefix" not in NatsAuth().options("nats://token@nats:4222")


def _jwt(issuer: object, claims: dict) -> str:
    """A NATS JWT (header, claims, ed25519 signature of the issuer's NKey), as `nsc` writes them."""
    import base64
    import hashlib
    import json
    import time

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    header = b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = {**claims, "iat": int(time.time()), "jti": ""}
    digest = hashlib.sha512(json.dumps(body, separators=(",", ":")).encode()).digest()[:32]
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    payload = b64(json.dumps(body, separators=(",", ":")).encode())
    signature = issuer.sign(f"{header}.{payload}".encode())  # type: ignore[attr-defined]
    return f"{header}.{payload}.{b64(signature)}"


async def test_event_bus_logs_in_with_a_credentials_file(tmp_path: Path) -> None:
    """Operator mode (JWTs): the user's JWT and NKey seed in one `.creds` file, as `nsc` writes it."""
    import os

    import nkeys

    def pair(prefix: int) -> tuple[bytes, object, str]:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        keys = nkeys.from_seed(bytearray(seed))
        return seed, keys, keys.public_key.decode()

    _, operator, operator_pub = pair(nkeys.PREFIX_BYTE_OPERATOR)
    _, account, account_pub = pair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, _, system_pub = pair(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed, _, user_pub = pair(nkeys.PREFIX_BYTE_USER)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
                 "leaf": -1}  # fmt: skip
    storage = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    (tmp_path / "op.jwt").write_text(
        _jwt(
            operator,
            {"iss": operator_pub, "sub": operator_pub, "name": "op", "nats": {"type": "operator", "version": 2}},
        )
    )
    gpushare = _jwt(
        operator,
        {
            "iss": operator_pub,
            "sub": account_pub,
            "name": "gpushare",
            "nats": {"limits": {**unlimited, **storage}, "type": "account", "version": 2},
        },
    )
    system = _jwt(
        operator,
        {
            "iss": operator_pub,
            "sub": system_pub,
            "name": "SYS",
            "nats": {"limits": unlimited, "type": "account", "version": 2},
        },
    )
    user = _jwt(account, {"iss": account_pub, "sub": user_pub, "name": "gpushare-binder",
                          "nats": {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user",
                                   "version": 2}})  # fmt: skip
    (tmp_path / "nats.conf").write_text(
        f"operator: {tmp_path / 'op.jwt'}\nsystem_account: {system_pub}\nresolver: MEMORY\n"
        f'resolver_preload: {{\n  {account_pub}: "{gpushare}"\n  {system_pub}: "{system}"\n}}\n'
    )
    creds = tmp_path / "gpushare-binder.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n"
    )
    assert await _admission(tmp_path, NatsAuth(creds_file=creds)) == (True, True)  # admitted; bare refused


async def test_accounting_reads_samples_keeps_snapshots_and_trims(connect, caplog: pytest.LogCaptureFixture) -> None:
    """Accounting's housekeeping with its own user: a durable consumer of the samples stream, ledger snapshots in
    the object store, the ledger stream trimmed once every durable consumer read it. A node agent reads none."""
    caplog.set_level(logging.WARNING, logger="shared.events.bus")
    extender = await connect("extender")
    accounting = await connect("accounting")
    got: list[Event] = []

    async def handle(event: Event) -> None:
        got.append(event)

    samples = DurableConsumer(accounting, "perm-samples", handle, kinds=["usage"], stream=NAMES.samples_stream)
    stop = asyncio.Event()
    task = asyncio.create_task(samples.run(stop))
    try:
        await extender.publish(inventory("n4"))
        await extender.publish(reserved("n4"))
        await extender.publish(UsageEvent(node="n4", samples=[]))
        await eventually(lambda: any(e.kind == "usage" for e in got), what="accounting's samples consumer")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)

    first = await take_snapshot(accounting, keep=1)
    assert first.written and first.events == 2 and first.trimmed == 2, first
    await extender.publish(reserved("n4"))
    second = await take_snapshot(accounting, keep=1)
    assert second.written and second.deleted and second.trimmed == 1, second
    newest = await SnapshotStore(accounting).newest()
    assert newest is not None and newest.sequence == second.sequence

    with pytest.raises((TimeoutError, NatsError)):
        await asyncio.wait_for(_node_agent_reads_snapshots(connect), 15)
    await refused(caplog, "Publish", f"$JS.API.STREAM.INFO.OBJ_{NAMES.snapshot_bucket}")


async def _node_agent_reads_snapshots(connect) -> None:  # type: ignore[no-untyped-def]
    agent = await connect("node-agent")
    await SnapshotStore(agent).newest()
