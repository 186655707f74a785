"""Durations and sizes as people write them in settings: `24h`, `7d`, `90s`, `2GiB`, `500MB`."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_SECONDS: dict[str | None, float] = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800, None: 1}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)
_BYTES: dict[str | None, float] = {
    None: 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _parse(value: object, pattern: re.Pattern[str], units: dict[str | None, float], what: str, hint: str) -> float:
    """A number (already in the base unit) or a number with a unit, as a non-negative float."""
    if isinstance(value, bool):
        raise ValueError(f"a {what} must be a number or a text like {hint.split(', ')[0]}")
    if isinstance(value, int | float):
        amount = float(value)
    else:
        match = pattern.match(str(value))
        if match is None:
            raise ValueError(f"{value!r} is not a {what}: write a number, or one with {hint}")
        unit = match.group(2).lower() if match.group(2) else None
        amount = float(match.group(1)) * units[unit]
    if amount < 0:
        raise ValueError(f"a {what} cannot be negative ({value!r})")
    return amount


def parse_duration(value: object) -> float:
    """Seconds from `90`, `90s`, `15m`, `24h`, `7d`, `1w` or `250ms` (a number is seconds)."""
    return _parse(value, _DURATION, _SECONDS, "duration", "24h, ms, s, m, h, d or w")


def parse_size(value: object) -> int:
    """Bytes from `1048576`, `500MB`, `2GiB` (a number is bytes)."""
    return int(_parse(value, _SIZE, _BYTES, "size", "2GiB, KB, MB, GB, KiB, MiB or GiB"))
