"""The ledger's gateway for node agents: node snapshots and agent commands over NATS request/reply.

Node agents hold no database connection (a DaemonSet on every GPU node would otherwise need one each, and
database credentials on every node). The binder answers for them, in a queue group so that any replica can:

* `<prefix>-rpc.snapshot.<node>`: the node's live containers and the stream sequence the snapshot covers
  (read *before* the ledger, so every event after it is either already in the snapshot, and re-applied
  idempotently by the agent, or new);
* `<prefix>-rpc.command.<node>`: an inventory, health, assigned or exchanged event, applied to the ledger
  with its event staged in the outbox like every ledger change. An agent speaks only for its own node. An
  exchange is applied at most once per event id (a repeat after a lost reply is answered "done"); the others
  are idempotent by nature. A refused command says why; a failing database gives a short, retryable answer
  (the driver's text stays in this log, never in a pod's condition): why the ledger cannot commit when that is
  known (a synchronous standby that does not confirm, say), else that it is unavailable.
* `<prefix>-rpc.commands.<node>`: several such commands at once (what an agent has to say together: every
  container of a pod it confirms), answered in order.

`assigned` commands, whichever request brings them, are group-committed (`GroupCommit`): those that arrive while
a transaction is in flight share the next one (`Ledger.mark_assigned_many`: the allocations locked, checked and
stamped in three statements), so a pod's containers confirmed together, and the pods of a burst, cost one
transaction, not one per container.

Once an exchange is applied and the agent answered, `on_exchanged` (the binder's `AnnotationSync`) rewrites both
pods' annotations at once: the `exchanged` event's consumer would do it too, but it shares its queue with every
`assigned` event, and under a burst of pods that queue held an exchange's rewrite back for 10-20 s while the pods'
`ALIYUN_COM_GPU_MEM_IDX` named each other's GPUs. The consumer stays the durable path (a rewrite this replica
could not finish, a crash): it then finds the pods up to date.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg

from services.binder import reads
from services.binder.metrics import BinderMetrics
from shared.events.agent_rpc import (
    COMMAND_EVENTS,
    COMMAND_KINDS,
    GATEWAY_QUEUE,
    MAX_BATCH,
    BatchReply,
    CommandReply,
    ErrorReply,
    rpc_prefix,
)
from shared.events.bus import EventBus
from shared.events.catalogue import AssignedEvent, EventDecodeError, ExchangedEvent, decode_event, node_token
from shared.ledger.db import is_transient, unavailable_reason
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import is_repeat_of_staged_event
from shared.ledger.rules import ExchangeRefused, is_live

log = logging.getLogger(__name__)

CONSUMER = "agent-gateway"
FOLLOW_UPS = 8  # exchanges whose annotation rewrite runs at once (more wait for a slot)


class LedgerGateway:
    """Answers node agents' snapshot requests and commands."""

    def __init__(
        self,
        ledger: Ledger,
        bus: EventBus,
        *,
        metrics: BinderMetrics,
        concurrency: int = 16,
        on_exchanged: Callable[[ExchangedEvent], Awaitable[object]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.bus = bus
        self.metrics = metrics
        self.on_exchanged = on_exchanged
        self._slots = asyncio.Semaphore(concurrency)
        self._assigned: GroupCommit[AssignedEvent, str | None] = GroupCommit(ledger.mark_assigned_many, what="assigned")
        self._follow_ups = asyncio.Semaphore(FOLLOW_UPS)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Any = None
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve requests until `stop` (the subscription survives NATS reconnects)."""
        self._sub = await self.bus.nc.subscribe(
            f"{rpc_prefix(self.bus.names.prefix)}.>", queue=GATEWAY_QUEUE, cb=self._on_msg
        )
        self.ready.set()
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_msg(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Msg) -> None:
        parts = msg.subject.split(".")
        verb, node = (parts[-2], parts[-1]) if len(parts) >= 3 else ("", "")
        replies: list[CommandReply] = []
        async with self._slots:
            if verb == "snapshot":
                body = await self.snapshot(node)
            elif verb == "command":
                replies = [await self.command(node, msg.data)]
                body = replies[0].model_dump_json().encode()
            elif verb == "commands":
                batch = await self.commands(node, msg.data)
                replies = batch.replies if isinstance(batch, BatchReply) else []
                body = batch.model_dump_json().encode()
            else:
                body = ErrorReply(error=f"unknown request {verb!r}").model_dump_json().encode()
        self.metrics.gateway_requests.labels(verb=verb or "unknown").inc()
        if msg.reply:
            with contextlib.suppress(Exception):  # the agent gave up waiting; it asks again
                await msg.respond(body)
        if self.on_exchanged is not None:
            for reply in replies:
                if reply.ok and reply.event is not None and reply.event.get("kind") == "exchanged":
                    await self._follow_up(ExchangedEvent.model_validate(reply.event), self.on_exchanged)

    async def _follow_up(self, event: ExchangedEvent, rewrite: Callable[[ExchangedEvent], Awaitable[object]]) -> None:
        """Rewrite the exchanged pods' annotations now (after the agent has its answer); a failure is left to the
        `exchanged` event's durable consumer."""
        async with self._follow_ups:
            try:
                await rewrite(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "annotations after exchange %s: %r; the exchanged event's consumer will rewrite them",
                    event.event_id,
                    exc,
                    extra={"node": event.node},
                )

    async def snapshot(self, node: str) -> bytes:
        """The node's snapshot as JSON (or an error body)."""
        try:
            info = await self.bus.js.stream_info(self.bus.names.stream)
            snap = await reads.node_snapshot(self.ledger.engine, node, int(info.state.last_seq), now=datetime.now(UTC))
        except Exception as exc:
            if not is_transient(exc):
                log.exception("snapshot for node %s failed", node, extra={"node": node})
                return ErrorReply(error="the ledger could not read the node's snapshot").model_dump_json().encode()
            log.warning("snapshot for node %s failed: %r", node, exc, extra={"node": node})
            return ErrorReply(error=unavailable_reason(exc), retryable=True).model_dump_json().encode()
        return snap.model_dump_json().encode()

    async def commands(self, node: str, data: bytes) -> BatchReply | ErrorReply:
        """Apply a batch of agent commands for `node` (a JSON array of events), all at once; one reply each."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            return ErrorReply(error=f"unreadable batch of commands: {exc}")
        if not isinstance(raw, list) or not raw:
            return ErrorReply(error="a batch of commands must be a non-empty JSON array of events")
        if len(raw) > MAX_BATCH:
            return ErrorReply(error=f"a batch holds at most {MAX_BATCH} commands, not {len(raw)}")
        replies = await asyncio.gather(*(self.command(node, json.dumps(item)) for item in raw))
        return BatchReply(replies=list(replies))

    async def command(self, node: str, data: bytes | str) -> CommandReply:
        """Apply one agent command for `node` (the subject's node token)."""
        try:
            event = decode_event(data)
        except EventDecodeError as exc:
            return CommandReply(ok=False, error=f"unreadable command: {exc}")
        if event.kind not in COMMAND_KINDS or not isinstance(event, COMMAND_EVENTS):
            return CommandReply(ok=False, error=f"{event.kind} is not a node agent command")
        speaks_for = node_token(event.node)  # type: ignore[union-attr]
        if speaks_for != node:
            return CommandReply(ok=False, error=f"a node agent speaks only for its own node, not {speaks_for}")
        try:
            if isinstance(event, AssignedEvent):
                batched = await self._assign(event)
                if batched is not None:
                    return batched
                # its batch failed as a whole: this command alone, checked and recorded as before batches
                where = await reads.allocation_node_state(self.ledger.engine, event.allocation_id)
                if where is None:
                    return CommandReply(ok=False, error=f"the ledger has no allocation {event.allocation_id}")
                if where[0] != event.node or not is_live(where[1]):
                    return CommandReply(ok=False, error=f"allocation {event.allocation_id} is {where[1]} on {where[0]}")
            if isinstance(event, ExchangedEvent):
                result = await self.ledger.record_once(event, CONSUMER)
            else:
                result = await self.ledger.record(event)  # type: ignore[arg-type]
        except ExchangeRefused as exc:
            return CommandReply(ok=False, error=f"the ledger refused the exchange: {exc}")
        except Exception as exc:
            if is_repeat_of_staged_event(exc):  # an agent sent it again while the first copy waited for us
                log.info("command %s from node %s: applied already", event.kind, node, extra={"node": node})
                return CommandReply(ok=True, event=event.model_dump(mode="json"))
            if not is_transient(exc):
                log.exception("command %s from node %s failed", event.kind, node, extra={"node": node})
                return CommandReply(ok=False, error=f"the ledger could not apply the {event.kind} command")
            log.warning("command %s from node %s failed: %r", event.kind, node, exc, extra={"node": node})
            return CommandReply(ok=False, error=unavailable_reason(exc), retryable=True)
        staged = result if isinstance(result, ExchangedEvent) else event
        return CommandReply(ok=True, event=staged.model_dump(mode="json"))

    async def _assign(self, event: AssignedEvent) -> CommandReply | None:
        """An `assigned` command through the group commit; None when its batch failed as a whole for a reason that
        does not pass (an event id a second binder replica staged meanwhile, say): the caller then applies it
        alone."""
        try:
            refused = await self._assigned.submit(event)
        except Exception as exc:
            if is_transient(exc):
                raise
            log.info("a batch of assigned commands failed (%r); applying %s alone", exc, event.event_id)
            return None
        if refused:
            return CommandReply(ok=False, error=refused)
        return CommandReply(ok=True, event=event.model_dump(mode="json"))
