"""What node agents and the ledger's gateway say to each other over NATS request/reply.

Node agents hold no database connection. An agent asks the gateway (run by the binder, a queue group so any
replica answers) for a snapshot of its node, then follows its node's events on the stream from the sequence
the snapshot covers; it sends its inventory, health, assignments and exchanges as commands, which the gateway
applies to the ledger (each with its event staged in the outbox, as every ledger change) and answers.

Subjects live outside the event stream's `<prefix>.>` so that JetStream never stores a request:
`<prefix>-rpc.snapshot.<node>`, `<prefix>-rpc.command.<node>` (one event) and `<prefix>-rpc.commands.<node>` (a
JSON array of events, answered by a `BatchReply` in the same order: what an agent has to say at once goes in one
request, and a gateway of a release before batches answers it with an `ErrorReply` naming the unknown request).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from shared.events.catalogue import AssignedEvent, ExchangedEvent, HealthEvent, InventoryEvent, Name, node_token

GATEWAY_QUEUE = "gpushare-ledger-gateway"
# what a node agent may ask the gateway to record (the classes, so that its grants can be read from the code)
COMMAND_EVENTS = (InventoryEvent, HealthEvent, AssignedEvent, ExchangedEvent)
COMMAND_KINDS = frozenset(cls.model_fields["kind"].default for cls in COMMAND_EVENTS)


def rpc_prefix(prefix: str) -> str:
    """The subject prefix of requests (outside the event stream)."""
    return f"{prefix}-rpc"


def snapshot_subject(prefix: str, node: str) -> str:
    """Where an agent asks for its node's snapshot."""
    return f"{rpc_prefix(prefix)}.snapshot.{node_token(node)}"


def command_subject(prefix: str, node: str) -> str:
    """Where an agent sends its commands."""
    return f"{rpc_prefix(prefix)}.command.{node_token(node)}"


class ShareRecord(BaseModel):
    """A container's share of one GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_uuid: Name
    gpu_index: Annotated[int, Field(ge=0, le=1024)]
    memory_mib: Annotated[int, Field(ge=0)]
    compute: Annotated[int, Field(ge=0)] = 0


class ContainerRecord(BaseModel):
    """A container of a live allocation on the node, as the ledger holds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allocation_id: uuid.UUID
    pod_uid: Name
    namespace: Name
    pod_name: Name
    container: Name
    container_index: Annotated[int, Field(ge=0)]
    init: bool = False
    sidecar: bool = False  # an init container with restartPolicy Always: it runs for the pod's whole life
    shares: Annotated[list[ShareRecord], Field(min_length=1)]
    reserved_at: datetime
    pod_created_at: datetime | None = None
    bound_at: datetime | None = None
    assigned: bool = False
    version: Annotated[int, Field(ge=1)] = 1


class NodeSnapshot(BaseModel):
    """Every live container on a node, and the last stream sequence whose effects it contains.

    `ended` lists allocations of the node that ended recently, so that a `reserved` event replayed from the
    stream after the snapshot cannot bring one of them back.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: Name
    stream_seq: Annotated[int, Field(ge=0)]
    containers: list[ContainerRecord] = Field(default_factory=list)
    ended: list[uuid.UUID] = Field(default_factory=list)


def commands_subject(prefix: str, node: str) -> str:
    """Where an agent sends several commands at once."""
    return f"{rpc_prefix(prefix)}.commands.{node_token(node)}"


MAX_BATCH = 64  # commands in one request (a gateway refuses more)


class CommandReply(BaseModel):
    """The gateway's answer to a command: done (with the event as staged), refused, or failed for now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    error: Annotated[str, Field(max_length=2048)] = ""
    retryable: bool = False
    event: dict[str, Any] | None = None  # the staged event (an exchange carries its result)


class ErrorReply(BaseModel):
    """The gateway's answer to a request it could not read or serve."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error: Annotated[str, Field(max_length=2048)]
    retryable: bool = False


class BatchReply(BaseModel):
    """The gateway's answers to a batch of commands, one per command, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replies: list[CommandReply]
