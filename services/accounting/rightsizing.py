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


IDLE_SM_PCT = 1.0
"""A workload whose pods' SM utilisation never reached this (percent of a GPU) in the window idles its compute."""


@dataclass(frozen=True)
class ComputeAdvice:
    """What a workload's SM utilisation says about its share: idle compute, or a gpu-core share to lower."""

    idle: bool
    recommended_compute: int | None
    text: str


def compute_advice(
    sm_peak_pct: float | None, allocated_compute: int, *, headroom: float = DEFAULT_HEADROOM
) -> ComputeAdvice:
    """Advice from the peak SM utilisation of a workload's pods (None: never measured, no advice).

    A share whose compute idles (peak below `IDLE_SM_PCT`) holds GPU memory for nothing: scale it to zero while
    idle. With a gpu-core share (`allocated_compute`, percent of one GPU), a peak plus headroom below it is a
    smaller gpu-core; one above it is reported (gpu-core is a scheduling share, not a cap)."""
    if sm_peak_pct is None:
        return ComputeAdvice(False, None, "")
    if sm_peak_pct < IDLE_SM_PCT:
        return ComputeAdvice(
            True, None, f"its compute idles (SM peak {sm_peak_pct:.1f} % of a GPU): scale it to zero while idle"
        )
    if allocated_compute <= 0:
        return ComputeAdvice(False, None, "")
    wanted = math.ceil(sm_peak_pct * (1 + headroom) - 1e-9)
    if wanted < allocated_compute:
        return ComputeAdvice(
            False, wanted, f"SM peak {sm_peak_pct:.0f} % of its gpu-core {allocated_compute}: gpu-core {wanted}"
        )
    if sm_peak_pct > allocated_compute:
        return ComputeAdvice(False, None, f"SM peak {sm_peak_pct:.0f} % exceeds its gpu-core {allocated_compute}")
    return ComputeAdvice(False, None, "")
