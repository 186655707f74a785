"""The JetStream connection: the ledger stream, the samples stream and the parking stream (each with a dedup
window), publishing with `Nats-Msg-Id`. Which kinds go to which stream: `shared.events.streams`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared.events.auth import NatsAuth
from shared.events.catalogue import encode_event, subject_for
from shared.events.streams import LEDGER_KINDS, SAMPLE_KINDS, StreamLimits
from shared.logging import redact
from shared.settings import DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX

log = logging.getLogger(__name__)

DEDUP_WINDOW_S = 120.0
# A server that stops answering (frozen, cut off, its machine gone without a TCP reset) is given up after this many
# unanswered pings, one every PING_INTERVAL_S: 4-6 s, then the client reconnects to another server of the cluster.
# A connection attempt gives up after CONNECT_TIMEOUT_S: a frozen server accepts TCP connections (its kernel does)
# and never says hello, and a healthy one says it at once.
PING_INTERVAL_S = 2.0
MAX_OUTSTANDING_PINGS = 2
CONNECT_TIMEOUT_S = 2.0


def nats_servers(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or a cluster's members separated by commas
    (`nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222`; a bare host:port gets nats://)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}; expected nats://host:4222[,nats://host2:4222,...]")
    return [u if "://" in u else f"nats://{u}" for u in servers]


@dataclass(frozen=True)
class BusNames:
    """Where events live: the stream, the subject prefix, and the parking stream for poison messages."""

    stream: str = DEFAULT_STREAM
    prefix: str = DEFAULT_SUBJECT_PREFIX

    @property
    def parked_stream(self) -> str:
        """The stream that keeps messages no consumer could apply."""
        return f"{self.stream}_PARKED"

    @property
    def parked_prefix(self) -> str:
        """The subject prefix of parked messages (outside the main stream's subjects)."""
        return f"{self.prefix}-parked"

    @property
    def samples_stream(self) -> str:
        """The stream that keeps usage and refused events for a limited age."""
        return f"{self.stream}_SAMPLES"

    @property
    def snapshot_bucket(self) -> str:
        """The JetStream object store that keeps ledger snapshots."""
        return f"{self.stream}_SNAPSHOTS"

    def subject(self, kind: str = "*", node: str = ">") -> str:
        """A subject or filter: `<prefix>.<kind>.<node>`."""
        return f"{self.prefix}.{kind}.{node}"

    def stream_subjects(self, samples: bool) -> list[str]:
        """The subjects of the samples stream, or of the ledger stream (one per kind: streams may not overlap)."""
        return sorted(self.subject(kind, ">") for kind in (SAMPLE_KINDS if samples else LEDGER_KINDS))

    def stream_of(self, kind: str) -> str:
        """The stream that keeps events of `kind`."""
        return self.samples_stream if kind in SAMPLE_KINDS else self.stream


class EventBus:
    """A NATS connection with JetStream, bound to the project's stream names."""

    def __init__(self, nc: Client, names: BusNames, *, replicas: int = 1) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.names = names
        self.replicas = replicas

    @classmethod
    async def connect(
        cls,
        url: str,
        names: BusNames | None = None,
        *,
        name: str = "gpushare",
        replicas: int = 1,
        limits: StreamLimits | None = None,
        auth: NatsAuth | None = None,
    ) -> EventBus:
        """Connect (one attempt: a server that is away raises at once; once connected, reconnecting forever on
        loss) and make sure the streams exist (with `replicas` copies each; a 3-server NATS cluster wants 3: a
        stream with fewer is raised to it, never lowered). `url` may list a cluster's servers, comma-separated
        (`nats_servers`): the first connection takes any of them, a lost one is replaced by another, and a
        server that stops answering is given up after `MAX_OUTSTANDING_PINGS` unanswered pings. `limits` are
        applied to the streams when given (a process without its own settings creates missing streams with the
        defaults and leaves existing limits alone). `auth`: credentials, client certificate, inbox prefix
        (`shared.events.auth`)."""
        servers = nats_servers(url)
        options = (auth or NatsAuth()).options(servers[0])
        url_for_logs = redact(url)
        connected = False

        async def _disconnected() -> None:
            if connected:
                log.warning("lost the NATS connection; reconnecting", extra={"nats_url": url_for_logs})

        async def _reconnected() -> None:
            server = nc.connected_url.netloc if nc.connected_url else "?"
            log.info("reconnected to NATS (%s)", redact(server), extra={"nats_url": url_for_logs})

        async def _error(exc: Exception) -> None:
            if connected:  # a failed first attempt is the caller's to report (once)
                log.warning("NATS client error: %s", exc)

        # the first connection gets two tries of every server (the caller decides whether and when to try again);
        # once it is up, a lost connection is re-established for ever
        nc = await nats.connect(
            servers,
            name=name,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.5,
            connect_timeout=CONNECT_TIMEOUT_S,
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
            error_cb=_error,
            **options,
        )
        nc.options["max_reconnect_attempts"] = -1
        connected = True
        bus = cls(nc, names or BusNames(), replicas=replicas)
        try:
            await bus.ensure_streams(limits)
        except BaseException:
            await nc.close()
            raise
        return bus

    async def ensure_streams(self, limits: StreamLimits | None = None) -> None:
        """Create the ledger, samples and parking streams when missing, and bring existing ones to the
        subjects this release expects (idempotent).

        A stream from before the samples stream existed holds `<prefix>.>`: its subjects are narrowed to the
        ledger kinds first (streams may not overlap), then the samples stream is created. Messages already
        stored stay where they are; replay ignores the kinds it does not fold, and the snapshot job purges
        them once every durable consumer has passed them.
        """
        explicit = limits is not None
        limits = limits or StreamLimits()
        for stream, subjects, (max_age, max_bytes) in (
            (self.names.stream, self.names.stream_subjects(samples=False), limits.age_and_bytes(samples=False)),
            (self.names.samples_stream, self.names.stream_subjects(samples=True), limits.age_and_bytes(samples=True)),
            (self.names.parked_stream, [f"{self.names.parked_prefix}.>"], (0.0, 0)),
        ):
            await self._ensure_stream(stream, subjects, max_age, max_bytes, set_limits=explicit)

    async def _ensure_stream(
        self, stream: str, subjects: list[str], max_age: float, max_bytes: int, *, set_limits: bool
    ) -> None:
        try:
            info = await self.js.stream_info(stream)
        except NotFoundError:
            try:
                await self.js.add_stream(
                    StreamConfig(
                        name=stream,
                        subjects=subjects,
                        retention=RetentionPolicy.LIMITS,
                        storage=StorageType.FILE,
                        duplicate_window=_dedup_window(max_age),
                        num_replicas=self.replicas,
                        max_age=max_age,
                        max_bytes=max_bytes or -1,
                    )
                )
            except APIError as exc:
                raise self._replicas_refused(stream, exc) from exc
            log.info(
                "created JetStream stream",
                extra={"stream": stream, "subjects": subjects, "max_age_s": max_age, "replicas": self.replicas},
            )
            return
        config, changes = info.config, dict[str, Any]()
        if sorted(config.subjects or []) != subjects:
            changes["subjects"] = subjects
        if set_limits and ((config.max_age or 0.0), max(config.max_bytes or 0, 0)) != (max_age, max_bytes):
            changes.update(max_age=max_age, max_bytes=max_bytes or -1, duplicate_window=_dedup_window(max_age))
        if (config.num_replicas or 1) < self.replicas:  # a single server grown into a cluster: copies on each
            changes["num_replicas"] = self.replicas
        if changes:
            try:
                await self.js.update_stream(config.evolve(**changes))
            except APIError as exc:
                raise self._replicas_refused(stream, exc) from exc
            log.info(
                "updated JetStream stream %s: %s",
                stream,
                ", ".join(f"{k}={v}" for k, v in changes.items()),
                extra={"stream": stream, "subjects": subjects},
            )

    async def ensure_replicas(self, stream: str) -> None:
        """Raise an existing stream to this bus's replicas, never lower (the snapshot store's backing stream: its
        owner, accounting, does it when it opens the store)."""
        try:
            info = await self.js.stream_info(stream)
        except NotFoundError:
            return
        if (info.config.num_replicas or 1) < self.replicas:
            try:
                await self.js.update_stream(info.config.evolve(num_replicas=self.replicas))
            except APIError as exc:
                raise self._replicas_refused(stream, exc) from exc
            log.info("updated JetStream stream %s: num_replicas=%d", stream, self.replicas, extra={"stream": stream})

    def _replicas_refused(self, stream: str, exc: APIError) -> Exception:
        """The server's refusal, said in terms of the setting when replicas are what it could not provide."""
        text = (exc.description or "").lower()
        if self.replicas > 1 and any(m in text for m in ("replica", "insufficient resources", "clustered")):
            return RuntimeError(
                f"JetStream refused stream {stream} with {self.replicas} replicas ({exc.description}): "
                f"GPUSHARE_STREAM_REPLICAS={self.replicas} needs a NATS cluster of at least {self.replicas} "
                "servers with JetStream (1 for a single server)"
            )
        return exc

    async def publish(self, event: object) -> PubAck:
        """Publish one event; a repeat of the same event id within the dedup window is dropped."""
        return await self.publish_raw(
            subject_for(self.names.prefix, event),  # type: ignore[arg-type]
            encode_event(event),  # type: ignore[arg-type]
            str(event.event_id),  # type: ignore[attr-defined]
        )

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str) -> PubAck:
        """Publish already-encoded bytes with an explicit message id."""
        return await self.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})

    async def delete_streams(self) -> None:
        """Remove every stream and the snapshot store (tests and `--reset` only)."""
        names = self.names
        for stream in (names.stream, names.samples_stream, names.parked_stream, f"OBJ_{names.snapshot_bucket}"):
            try:
                await self.js.delete_stream(stream)
            except NotFoundError:
                pass

    async def close(self) -> None:
        """Flush what was published and close the connection."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.flush(timeout=2)
        except Exception as exc:  # closing anyway
            log.debug("flush before close failed: %s", exc)
        await self.nc.close()


def _dedup_window(max_age: float) -> float:
    """The dedup window: two minutes, never longer than the stream keeps messages (JetStream's rule)."""
    return min(DEDUP_WINDOW_S, max_age) if max_age > 0 else DEDUP_WINDOW_S
