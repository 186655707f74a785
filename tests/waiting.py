"""The one polling helper of the test suite: wait for a condition instead of sleeping a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(
    check: Callable[[], Any | Awaitable[Any]], *, what: str, within: float = 20.0, interval: float = 0.05
) -> Any:
    """Call `check` (plain or async) until it returns something truthy, and return that; TimeoutError naming
    `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(interval)
