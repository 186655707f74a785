"""Group commit: callers that arrive while a ledger transaction is in flight go together in the next one.

Each caller still gets its own answer (a result, or the exception that concerns only its item). One batch is
in flight at a time per `GroupCommit`: under light load a caller's batch starts at once (a batch of one),
under heavy load each transaction carries everyone who queued during the previous one, so the number of
transactions, commits and relay flushes per item falls as the load rises. A caller cancelled before its batch
starts is left out of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from prometheus_client import Histogram

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

BATCH_SIZE = Histogram(
    "gpushare_ledger_group_commit_batch_size",
    "Items per group-commit transaction, by what is committed",
    ["what"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)


class GroupCommit(Generic[T, R]):
    """`await group.submit(item)` runs `run_batch` over the items queued together and returns this item's
    answer; `run_batch` returns one answer per item, in order, where an exception instance is raised to that
    item's caller alone. An exception raised by `run_batch` itself reaches every caller of that batch."""

    def __init__(
        self,
        run_batch: Callable[[list[T]], Awaitable[Sequence[R | BaseException]]],
        *,
        what: str,
        max_batch: int = 64,
        linger_s: float = 0.0,
    ) -> None:
        self.run_batch = run_batch
        self.what = what
        self.max_batch = max_batch
        # how long an idle group waits after its first caller before it starts a batch: the callers that come
        # meanwhile go in the same transaction (for writes nobody waits on, where a batch of one is the rule)
        self.linger_s = linger_s
        self.batches = 0
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        """Queue `item` for the next transaction and wait for its answer."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name=f"group-commit-{self.what}")
        return await future

    async def _drain(self) -> None:
        if self.linger_s > 0:
            await asyncio.sleep(self.linger_s)
        while self._queue:
            taken, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            batch = [(item, future) for item, future in taken if not future.done()]  # cancelled callers drop out
            if not batch:
                continue
            self.batches += 1
            BATCH_SIZE.labels(what=self.what).observe(len(batch))
            try:
                answers = await self.run_batch([item for item, _ in batch])
                if len(answers) != len(batch):
                    raise RuntimeError(f"{self.what}: {len(answers)} answers for {len(batch)} items")
            except BaseException as exc:  # every caller of this batch hears it (and may retry)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                if future.done():
                    continue
                if isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
