"""Right-sizing arithmetic (pure): what a workload should request given what it really used."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Recommendation:
    """A recommended share and what applying it would gain."""

    allocated_mib: int
    peak_mib: int
    p95_mib: int
    recommended_mib: int
    density_gain_pct: int
    text: str


def format_memory(mib: float) -> str:
    """`2 GiB`, `1.3 GiB`, `512 MiB`: one decimal at most, whole numbers without one."""
    if mib >= 1024:
        value = round(mib / 1024, 1)
        return f"{value:g} GiB"
    return f"{round(mib):d} MiB"


def round_up(mib: float, step_mib: int) -> int:
    """Round up to a whole number of steps (at least one step)."""
    step = max(1, step_mib)
    return max(step, math.ceil(mib / step - 1e-9) * step)


def recommend(
    allocated_mib: int, peak_mib: int, p95_mib: int, *, step_mib: int, headroom: float = DEFAULT_HEADROOM
) -> Recommendation:
    """Recommend the observed peak plus headroom, rounded up to `step_mib` (the resource unit).

    The density gain is how many more pods of the recommended size fit where the allocated size did:
    allocated / recommended - 1, truncated to a whole percent (negative when the workload needs more).
    """
    recommended = round_up(peak_mib * (1 + headroom), step_mib)
    gain = math.floor((allocated_mib / recommended - 1) * 100 + 1e-9) if allocated_mib > 0 else 0
    head = f"allocates {format_memory(allocated_mib)}, peaks at {format_memory(peak_mib)}"
    if recommended == allocated_mib:
        text = f"{head}: right-sized"
    elif recommended < allocated_mib:
        text = f"{head}: {gain} % more pods per GPU at {format_memory(recommended)}"
    else:
        text = f"{head}: needs {format_memory(recommended)} to keep {int(headroom * 100)} % headroom"
    return Recommendation(allocated_mib, peak_mib, p95_mib, recommended, gain, text)
