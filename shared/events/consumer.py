"""Durable JetStream consumers: explicit ack after the effect, bounded redelivery, poison parking.

A handler receives a decoded event and returns once its effect is durable (committed to the ledger, or
published). Only then is the message acked. A handler that fails because the database or the bus is away
(`shared.transient`) is retried in place with capped exponential backoff for as long as the outage lasts,
keeping the message in progress (an outage never parks an event, and events keep their order). A handler
that raises anything else is retried with backoff up to `max_deliver` times; after that, or at once for
messages that cannot be decoded or that the handler rejects with `PermanentError`, the message is copied to
the parking stream with its reason and terminated, so it is never looped. Handlers must be idempotent:
JetStream delivers at least once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared.events.bus import EventBus
from shared.events.catalogue import Event, EventDecodeError, decode_event
from shared.transient import BUS_TRANSIENT, is_transient_failure

log = logging.getLogger(__name__)

Handler = Callable[[Event], Awaitable[None]]
BatchHandler = Callable[[list[Event]], Awaitable[None]]


class PermanentError(Exception):
    """The handler will never be able to apply this event: park it instead of retrying."""


class DurableConsumer:
    """Pulls events of the given kinds from the stream and feeds them to a handler."""

    def __init__(
        self,
        bus: EventBus,
        durable: str,
        handler: Handler,
        *,
        kinds: Iterable[str] | None = None,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        batch: int = 64,
        backoff_s: float = 0.5,
        concurrency: int = 1,
        batch_handler: BatchHandler | None = None,
        linger_s: float = 0.0,
        stream: str | None = None,
        max_backoff_s: float = 10.0,
        transient: Callable[[BaseException], bool] = is_transient_failure,
        heartbeat_s: float | None = None,
    ) -> None:
        self.bus = bus
        self.stream = stream or bus.names.stream  # the ledger stream unless told (the samples stream, say)
        self.durable = durable
        self.handler = handler
        self.kinds = frozenset(kinds) if kinds else None
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.batch = batch
        self.backoff_s = backoff_s
        self.concurrency = max(1, concurrency)
        self.batch_handler = batch_handler if self.concurrency == 1 else None
        # with a batch handler: wait up to this long for a batch to fill (trades latency for fewer commits)
        self.linger_s = linger_s if self.batch_handler is not None else 0.0
        self.max_backoff_s = max_backoff_s
        self.transient = transient
        # with a heartbeat, a message being handled is marked in progress every `heartbeat_s`: a short `ack_wait`
        # then only decides how soon the messages of a consumer that died are delivered to another one
        if heartbeat_s is not None and not 0 < heartbeat_s < ack_wait_s:
            raise ValueError(f"heartbeat_s must be between 0 and ack_wait_s ({ack_wait_s:g}), not {heartbeat_s:g}")
        self.heartbeat_s = heartbeat_s
        self.applied = 0
        self.parked = 0
        self.outage_retries = 0  # handler calls retried because the database or the bus was away
        self.subscriptions = 0  # pull subscriptions made (once, unless the consumer had to be looked up again)
        self._bus_trouble_since: float | None = None  # when fetching began to fail with a passing bus error
        self.ready = asyncio.Event()
        self._stop: asyncio.Event | None = None

    def _filter_subject(self) -> str:
        names = self.bus.names
        if self.kinds and len(self.kinds) == 1:
            return names.subject(next(iter(self.kinds)), ">")
        return f"{names.prefix}.>"

    def _filter_subjects(self) -> list[str] | None:
        """One filter per kind when several kinds are wanted (the server then sends nothing else)."""
        if self.kinds and len(self.kinds) > 1:
            return [self.bus.names.subject(kind, ">") for kind in sorted(self.kinds)]
        return None

    async def _subscribe(self) -> Any:
        self.subscriptions += 1
        several = self._filter_subjects()
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver + 1,
            max_ack_pending=max(1000, self.batch * 4),
            filter_subject=None if several else self._filter_subject(),
            filter_subjects=several,
        )
        await self._follow_ack_wait(config)
        return await self.bus.js.pull_subscribe(
            self._filter_subject(), durable=self.durable, stream=self.stream, config=config
        )

    async def _follow_ack_wait(self, config: ConsumerConfig) -> None:
        """A durable that exists keeps the configuration it was created with; give it this consumer's ack wait
        (the binder's became shorter with its heartbeat: a release that changes it must not wait for a new durable).
        NATS updates a consumer created again under its name with an editable change."""
        try:
            info = await self.bus.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            return
        if info.config.ack_wait is not None and abs(info.config.ack_wait - self.ack_wait_s) > 0.001:
            log.info(
                "consumer %s: ack wait %.1fs -> %.1fs",
                self.durable,
                info.config.ack_wait,
                self.ack_wait_s,
                extra={"consumer": self.durable},
            )
            await self.bus.js.add_consumer(self.stream, config=dataclasses.replace(config, name=self.durable))

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until `stop` is set (or forever), surviving NATS outages.

        A continuous pipeline: up to `concurrency` handlers run at once and more messages are fetched as
        soon as a slot frees up, so one slow message holds only its own slot (with `concurrency` 1,
        messages are handled strictly one after the other). Handlers still running when `stop` is set
        are awaited; on cancellation they are cancelled (their messages are redelivered).
        """
        stop = stop or asyncio.Event()
        self._stop = stop
        sub = None
        in_flight: set[asyncio.Task[None]] = set()
        pending = 0  # how many more messages the server said were waiting after the last one fetched
        try:
            while not stop.is_set():
                try:
                    if sub is None:
                        sub = await self._subscribe()
                        self.ready.set()
                    if len(in_flight) >= self.concurrency:
                        await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                        continue
                    want = self._want(len(in_flight), pending)
                    try:
                        if self.linger_s > 0:
                            # batches: wait for a first message, give the rest `linger_s` to arrive, take up to
                            # `batch` (fetch returns what is available at once, so the pause is ours)
                            msgs = await sub.fetch(self.batch, timeout=1.0)
                            if len(msgs) < self.batch:
                                await asyncio.sleep(self.linger_s)
                                with contextlib.suppress(TimeoutError):
                                    msgs += await sub.fetch(self.batch - len(msgs), timeout=0.05)
                        else:
                            # one message: a lingering pull that returns as soon as it arrives; several (only when
                            # the server said they are waiting): returned at once, the short timeout only bounds
                            # the rare case where another subscriber took them meanwhile
                            msgs = await sub.fetch(want, timeout=1.0 if want == 1 else 0.2)
                    except TimeoutError:  # NATS' TimeoutError subclasses it
                        pending = 0
                        self._bus_back()
                        continue
                    pending = _num_pending(msgs[-1]) if msgs else 0
                    self._bus_back()
                    if self.concurrency == 1:
                        if self.batch_handler is not None and len(msgs) > 1:
                            await self.handle_batch(msgs)
                            continue
                        for msg in msgs:
                            await self.handle_message(msg)
                        continue
                    for msg in msgs:
                        task = asyncio.create_task(self.handle_message(msg))
                        in_flight.add(task)
                        task.add_done_callback(self._done(in_flight))
                except asyncio.CancelledError:
                    raise
                except BUS_TRANSIENT as exc:
                    if sub is None:
                        await self._lost_subscription(exc)
                        continue
                    # The consumer's leader is being elected (its server was lost) or the connection is being
                    # re-established: the pull subscription stays valid, and the next fetch reaches whichever
                    # server leads the consumer then. Looking the consumer up again instead would wait out the
                    # election and time out (5 s), then start over.
                    self._bus_trouble(exc)
                    pending = 0
                    await self._pause(0.25)
                except Exception as exc:
                    await self._lost_subscription(exc)
                    sub = None
                    pending = 0
            if in_flight:
                await asyncio.wait(set(in_flight))
        finally:
            self.ready.clear()
            for task in in_flight:
                task.cancel()
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception as exc:  # the connection may already be gone
                    log.debug("consumer %s: unsubscribe failed: %s", self.durable, exc)

    async def _lost_subscription(self, exc: BaseException) -> None:
        """The consumer could not be subscribed (or its subscription failed otherwise): try again in a second."""
        log.warning("consumer %s: %s; retrying", self.durable, exc, extra={"consumer": self.durable})
        self.ready.clear()
        await self._pause(1.0)

    def _bus_trouble(self, exc: BaseException) -> None:
        """One log line when fetching starts failing with a passing bus error (more at debug level)."""
        if self._bus_trouble_since is None:
            self._bus_trouble_since = time.monotonic()
            log.warning(
                "consumer %s: %r; fetching again until the bus answers",
                self.durable,
                exc,
                extra={"consumer": self.durable},
            )
        else:
            log.debug("consumer %s: still %r", self.durable, exc)

    def _bus_back(self) -> None:
        """Fetching works again: say how long it did not."""
        if self._bus_trouble_since is not None:
            log.info(
                "consumer %s: fetching again after %.1fs",
                self.durable,
                time.monotonic() - self._bus_trouble_since,
                extra={"consumer": self.durable},
            )
            self._bus_trouble_since = None

    def _want(self, running: int, pending: int) -> int:
        """How many messages to ask for: more than one only when the server said they are waiting, and
        never more than the free slots (with `concurrency` 1: up to `batch`, handled one after the other)."""
        free = self.batch if self.concurrency == 1 else self.concurrency - running
        return max(1, min(free, self.batch, pending))

    def _done(self, in_flight: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
        def _finished(task: asyncio.Task[None]) -> None:
            in_flight.discard(task)
            if not task.cancelled() and task.exception() is not None:
                # ack / nak / park failed (connection trouble): the message is redelivered after ack_wait
                log.warning(
                    "consumer %s: settling a message failed: %r",
                    self.durable,
                    task.exception(),
                    extra={"consumer": self.durable},
                )

        return _finished

    async def handle_batch(self, msgs: list[Any]) -> None:
        """Several messages through `batch_handler` at once (one transaction, say), acked together.

        Undecodable messages are parked and other kinds acked first, as one by one. If the batch handler
        raises, every message of the batch goes through `handle_message` instead, so one bad event is
        retried or parked on its own and never holds back the others.
        """
        handler = self.batch_handler
        assert handler is not None
        wanted: list[tuple[Any, Event]] = []
        for msg in msgs:
            event = await self._wanted(msg)
            if event is not None:
                wanted.append((msg, event))
        if not wanted:
            return
        events = [event for _, event in wanted]
        try:
            async with self._in_progress([m for m, _ in wanted]):
                await self._through_outages(lambda: handler(events), [m for m, _ in wanted], events[0])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info(
                "consumer %s: a batch of %d failed (%r); handling its messages one by one",
                self.durable,
                len(wanted),
                exc,
                extra={"consumer": self.durable},
            )
            for msg, _ in wanted:
                await self.handle_message(msg)
            return
        for msg, _ in wanted:
            await msg.ack()
        self.applied += len(wanted)

    async def _wanted(self, msg: Any) -> Event | None:
        """The message's event when this consumer handles it; else None, once it is parked (undecodable) or
        acked (a kind this consumer does not handle)."""
        try:
            event = decode_event(msg.data)
        except EventDecodeError as exc:
            await self._park(msg, f"undecodable: {exc}")
            return None
        if self.kinds is not None and event.kind not in self.kinds:
            await msg.ack()
            return None
        return event

    async def handle_message(self, msg: Any) -> None:
        """Decode, dispatch, and ack / retry / park one message."""
        event = await self._wanted(msg)
        if event is None:
            return
        try:
            async with self._in_progress([msg]):
                await self._through_outages(lambda: self.handler(event), [msg], event)
        except PermanentError as exc:
            await self._park(msg, f"rejected by handler: {exc}")
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            delivered = msg.metadata.num_delivered if msg.metadata else 1
            if delivered >= self.max_deliver:
                await self._park(msg, f"failed {delivered} times, last error: {exc!r}")
            else:
                delay = self.backoff_s * (2 ** (delivered - 1))
                log.warning(
                    "consumer %s: handling %s %s failed (attempt %d/%d): %r",
                    self.durable,
                    event.kind,
                    event.event_id,
                    delivered,
                    self.max_deliver,
                    exc,
                    extra={"consumer": self.durable, "event_id": str(event.event_id)},
                )
                await msg.nak(delay=delay)
            return
        await msg.ack()
        self.applied += 1

    @contextlib.asynccontextmanager
    async def _in_progress(self, msgs: list[Any]) -> AsyncIterator[None]:
        """With a heartbeat: mark `msgs` in progress every `heartbeat_s` while the body runs."""
        if self.heartbeat_s is None:
            yield
            return

        async def beat(period: float) -> None:
            while True:
                await asyncio.sleep(period)
                for msg in msgs:
                    with contextlib.suppress(Exception):  # the bus may be away: then the message is redelivered
                        await msg.in_progress()

        task = asyncio.create_task(beat(self.heartbeat_s))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _through_outages(self, call: Callable[[], Awaitable[None]], msgs: list[Any], event: Event) -> None:
        """Await `call()`, retrying it while it fails with a transient error (database or bus away), with capped
        exponential backoff and the messages kept in progress; one log line per attempt. Other errors, and a
        transient one once the consumer is stopping, are raised."""
        attempt, started = 0, time.monotonic()
        while True:
            try:
                await call()
                if attempt:
                    log.info(
                        "consumer %s: %s %s applied after %d retries over %.1fs",
                        self.durable,
                        event.kind,
                        event.event_id,
                        attempt,
                        time.monotonic() - started,
                        extra={"consumer": self.durable, "event_id": str(event.event_id)},
                    )
                return
            except Exception as exc:
                if isinstance(exc, PermanentError) or not self.transient(exc):
                    raise
                if self._stop is not None and self._stop.is_set():
                    raise
                attempt += 1
                self.outage_retries += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                log.warning(
                    "consumer %s: %s %s waits for the database or the bus (%r); attempt %d, retrying in %.1fs "
                    "(%.0fs so far)",
                    self.durable,
                    event.kind,
                    event.event_id,
                    exc,
                    attempt,
                    delay,
                    time.monotonic() - started,
                    extra={"consumer": self.durable, "event_id": str(event.event_id), "attempt": attempt},
                )
                for msg in msgs:  # not redelivered meanwhile (the bus may be away too: then it is, later)
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
                await self._pause(delay)

    async def _pause(self, delay: float) -> None:
        """Sleep `delay` seconds, or less when the consumer is asked to stop."""
        if self._stop is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)

    async def _park(self, msg: Any, reason: str) -> None:
        names = self.bus.names
        seq = msg.metadata.sequence.stream if msg.metadata else 0
        log.error(
            "consumer %s parked message seq=%s on %s: %s",
            self.durable,
            seq,
            msg.subject,
            reason,
            extra={"consumer": self.durable, "stream_seq": seq, "reason": reason},
        )
        try:
            await self.bus.js.publish(
                f"{names.parked_prefix}.{self.durable}",
                msg.data,
                headers={
                    "Nats-Msg-Id": f"{self.stream}-{self.durable}-{seq}",
                    "Gpushare-Parked-Reason": reason[:1000],
                    "Gpushare-Original-Subject": msg.subject,
                },
            )
        finally:
            await msg.term()
        self.parked += 1


def _num_pending(msg: Any) -> int:
    """Messages still waiting for this consumer after `msg`, as the server reported it (0 when unknown)."""
    try:
        return int(msg.metadata.num_pending or 0)
    except Exception:  # not a JetStream message (no ack subject to read it from)
        return 0
