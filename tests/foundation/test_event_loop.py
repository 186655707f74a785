"""Services run on uvloop unless GPUSHARE_EVENT_LOOP says otherwise."""

from __future__ import annotations

import asyncio

import pytest

from shared.runtime import loop_factory, run_main


def test_uvloop_by_default_and_the_stock_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSHARE_EVENT_LOOP", raising=False)
    factory = loop_factory()
    assert factory is not None and type(factory()).__module__.startswith("uvloop")
    assert loop_factory("asyncio") is None and loop_factory(" Asyncio ") is None
    with pytest.raises(ValueError, match="GPUSHARE_EVENT_LOOP must be 'uvloop' or 'asyncio'"):
        loop_factory("trio")


def test_run_main_runs_the_coroutine_on_the_chosen_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.setenv("GPUSHARE_EVENT_LOOP", "asyncio")
    assert run_main(which()).startswith("asyncio")
    monkeypatch.setenv("GPUSHARE_EVENT_LOOP", "uvloop")
    assert run_main(which()).startswith("uvloop")
