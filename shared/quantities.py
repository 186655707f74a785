"""Durations and sizes as people write them in settings: `24h`, `7d`, `90s`, `2GiB`, `500MB`."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800, None: 1}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)
_BYTES = {
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


def parse_duration(value: object) -> float:
    """Seconds from `90`, `90s`, `15m`, `24h`, `7d`, `1w` or `250ms` (a number is seconds)."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a text like 24h")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ValueError(f"{value!r} is not a duration: write seconds or a number with ms, s, m, h, d or w")
        seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative ({value!r})")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from `1048576`, `500MB`, `2GiB` (a number is bytes)."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a text like 2GiB")
    if isinstance(value, int | float):
        size = float(value)
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise ValueError(f"{value!r} is not a size: write bytes or a number with KB, MB, GB, KiB, MiB or GiB")
        unit = match.group(2).lower() if match.group(2) else None
        size = float(match.group(1)) * _BYTES[unit]
    if size < 0:
        raise ValueError(f"a size cannot be negative ({value!r})")
    return int(size)


def format_duration(seconds: float) -> str:
    """`24h`, `7d`, `90s`: the largest unit that divides the value, for logs and help texts."""
    for unit in ("w", "d", "h", "m"):
        step = _SECONDS[unit]
        if seconds >= step and seconds % step == 0:
            return f"{int(seconds // step)}{unit}"
    return f"{seconds:g}s"
