"""The node agent's only channel to the ledger: NATS request/reply with the binder's gateway, and its node's
events from the stream (see `shared.events.agent_rpc`).

`snapshot()` asks for the node's live containers; `follow()` then delivers the node's events from the
sequence the snapshot covers (a JetStream ordered consumer: no gap, no duplicate within one subscription);
`send()` applies a command and returns the gateway's answer, `send_many()` several in one request. Failures that
may pass (no gateway answering, a timeout, a database outage behind it) are retried with capped backoff until the
caller's deadline, then raised as `LedgerUnavailable`; a refusal is raised at once as `CommandRefused`. Both carry
a short reason fit for kubelet and a pod's events.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from shared.events.agent_rpc import (
    BatchReply,
    CommandReply,
    ErrorReply,
    NodeSnapshot,
    command_subject,
    commands_subject,
    snapshot_subject,
)
from shared.events.bus import EventBus
from shared.events.catalogue import Event, EventDecodeError, decode_event, encode_event, node_token

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0


class LedgerUnavailable(Exception):
    """The ledger could not be reached before the deadline (the message is fit for kubelet)."""


class CommandRefused(Exception):
    """The ledger refused a command (the message says why)."""


class LedgerLink:
    """Snapshot, follow and command, for one node."""

    def __init__(
        self,
        bus: EventBus,
        node: str,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.bus = bus
        self.node = node
        self.request_timeout_s = request_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sub: Any = None
        self.reachable = False  # the last request got an answer
        self.batches = True  # the gateway answers batches of commands (a gateway before them: one by one)

    async def snapshot(self, *, deadline_s: float) -> NodeSnapshot:
        """The node's live containers and the stream sequence they cover."""
        data = await self._request(snapshot_subject(self.bus.names.prefix, self.node), b"", deadline_s, "snapshot")
        try:
            return NodeSnapshot.model_validate_json(data)
        except ValidationError:
            error = _error_reply(data)
            raise LedgerUnavailable(error or "the ledger gateway sent an unreadable snapshot") from None

    async def send(self, event: Event, *, deadline_s: float) -> CommandReply:
        """Apply `event` in the ledger through the gateway; the reply carries the event as staged."""
        subject = command_subject(self.bus.names.prefix, self.node)
        started = time.monotonic()
        attempt = 0
        while True:
            remaining = deadline_s - (time.monotonic() - started)
            data = await self._request(subject, encode_event(event), remaining, event.kind)
            try:
                reply = CommandReply.model_validate_json(data)
            except ValidationError:
                raise CommandRefused(_error_reply(data) or "the ledger gateway sent an unreadable reply") from None
            if reply.ok:
                return reply
            if not reply.retryable:
                raise CommandRefused(reply.error)
            attempt += 1
            if time.monotonic() - started + self._delay(attempt) >= deadline_s:
                raise LedgerUnavailable(reply.error)
            await asyncio.sleep(self._delay(attempt))

    async def send_many(self, events: list[Event], *, deadline_s: float) -> list[CommandReply | Exception]:
        """Several commands in one request (`commands_subject`); per command its reply, or `CommandRefused`, or
        `LedgerUnavailable` when it could not be applied before the deadline (the ones the gateway asks to retry
        are sent again, together). A gateway of a release before batches gets them one by one."""
        if len(events) == 1 or not self.batches:
            return [await self._one(e, deadline_s) for e in events]
        subject = commands_subject(self.bus.names.prefix, self.node)
        started = time.monotonic()
        out: list[CommandReply | Exception | None] = [None] * len(events)
        todo = list(range(len(events)))
        attempt = 0
        while todo:
            remaining = deadline_s - (time.monotonic() - started)
            body = b"[" + b",".join(encode_event(events[i]) for i in todo) + b"]"
            try:
                data = await self._request(subject, body, remaining, "commands")
                batch = BatchReply.model_validate_json(data)
            except LedgerUnavailable as exc:
                for i in todo:
                    out[i] = exc
                break
            except ValidationError:
                error = _error_reply(data)
                if error.startswith("unknown request"):  # a gateway before batches
                    self.batches = False
                    for i in todo:
                        out[i] = await self._one(events[i], deadline_s - (time.monotonic() - started))
                    break
                for i in todo:
                    out[i] = CommandRefused(error or "the ledger gateway sent an unreadable reply")
                break
            again = []
            for i, reply in zip(todo, batch.replies, strict=False):
                if reply.ok:
                    out[i] = reply
                elif not reply.retryable:
                    out[i] = CommandRefused(reply.error)
                else:
                    again.append(i)
                    out[i] = LedgerUnavailable(reply.error)
            todo = again
            attempt += 1
            if todo and time.monotonic() - started + self._delay(attempt) >= deadline_s:
                break  # what is left keeps its LedgerUnavailable
            if todo:
                await asyncio.sleep(self._delay(attempt))
        return [r if r is not None else LedgerUnavailable("no answer") for r in out]

    async def _one(self, event: Event, deadline_s: float) -> CommandReply | Exception:
        try:
            return await self.send(event, deadline_s=deadline_s)
        except (CommandRefused, LedgerUnavailable) as exc:
            return exc

    async def follow(self, from_seq: int, on_event: Callable[[Event], Awaitable[None] | None]) -> None:
        """Deliver the node's events after stream sequence `from_seq` to `on_event`, until `unfollow`."""
        await self.unfollow()
        subject = self.bus.names.subject("*", node_token(self.node))

        async def on_msg(msg: Any) -> None:
            try:
                event = decode_event(msg.data)
            except EventDecodeError as exc:
                log.warning("ignored an unreadable event on %s: %s", msg.subject, exc)
                return
            result = on_event(event)
            if result is not None:
                await result

        self._sub = await self.bus.js.subscribe(
            subject,
            stream=self.bus.names.stream,
            cb=on_msg,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq + 1),
        )

    async def unfollow(self) -> None:
        """Stop following the stream."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may be gone already
                log.debug("unsubscribe failed: %s", exc)

    async def _request(self, subject: str, payload: bytes, deadline_s: float, what: str) -> bytes:
        started = time.monotonic()
        attempt = 0
        while True:
            remaining = deadline_s - (time.monotonic() - started)
            try:
                msg = await self.bus.nc.request(
                    subject, payload, timeout=max(0.05, min(self.request_timeout_s, remaining))
                )
                self.reachable = True
                return msg.data
            except (NoRespondersError, NatsTimeout, TimeoutError, ConnectionError) as exc:
                self.reachable = False
                attempt += 1
                delay = self._delay(attempt)
                if time.monotonic() - started + delay >= deadline_s:
                    reason = (
                        "no ledger gateway answers (is the binder running?)"
                        if isinstance(exc, NoRespondersError)
                        else "the ledger gateway did not answer in time"
                    )
                    raise LedgerUnavailable(f"{what}: {reason}") from None
                await asyncio.sleep(delay)

    def _delay(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2 ** max(0, attempt - 1))
        return base * (0.8 + 0.4 * random.random())


def _error_reply(data: bytes) -> str:
    try:
        return ErrorReply.model_validate_json(data).error
    except ValidationError:
        return ""
