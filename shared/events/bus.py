"""The JetStream connection: one stream with a dedup window, publishing with `Nats-Msg-Id`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from shared.events.auth import NatsAuth
from shared.events.catalogue import encode_event, subject_for
from shared.logging import redact
from shared.settings import DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX

log = logging.getLogger(__name__)

DEDUP_WINDOW_S = 120.0


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

    def subject(self, kind: str = "*", node: str = ">") -> str:
        """A subject or filter: `<prefix>.<kind>.<node>`."""
        return f"{self.prefix}.{kind}.{node}"


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
        auth: NatsAuth | None = None,
    ) -> EventBus:
        """Connect (reconnecting forever on loss) and make sure the streams exist (with `replicas`
        copies each when created here; a 3-server NATS cluster wants 3). `auth`: credentials, client
        certificate, inbox prefix (`shared.events.auth`)."""
        options = (auth or NatsAuth()).options(url)
        url_for_logs = redact(url)

        async def _disconnected() -> None:
            log.warning("lost the NATS connection; reconnecting", extra={"nats_url": url_for_logs})

        async def _reconnected() -> None:
            log.info("reconnected to NATS", extra={"nats_url": url_for_logs})

        async def _error(exc: Exception) -> None:
            log.warning("NATS client error: %s", exc)

        nc = await nats.connect(
            url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
            error_cb=_error,
            **options,
        )
        bus = cls(nc, names or BusNames(), replicas=replicas)
        await bus.ensure_streams()
        return bus

    async def ensure_streams(self) -> None:
        """Create the event stream and the parking stream when they are missing (idempotent)."""
        for stream, subjects in (
            (self.names.stream, [f"{self.names.prefix}.>"]),
            (self.names.parked_stream, [f"{self.names.parked_prefix}.>"]),
        ):
            try:
                await self.js.stream_info(stream)
            except NotFoundError:
                await self.js.add_stream(
                    StreamConfig(
                        name=stream,
                        subjects=subjects,
                        retention=RetentionPolicy.LIMITS,
                        storage=StorageType.FILE,
                        duplicate_window=DEDUP_WINDOW_S,
                        num_replicas=self.replicas,
                    )
                )
                log.info("created JetStream stream", extra={"stream": stream, "subjects": subjects})

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
        """Remove both streams (tests and `--reset` only)."""
        for stream in (self.names.stream, self.names.parked_stream):
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
