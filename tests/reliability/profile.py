"""How hard the reliability tests push: a bounded, seeded profile by default, a soak with GPUSHARE_SOAK=1.

Every scenario reads its sizes from here so that `make test` stays within a few minutes and
`make soak` runs the same code longer. GPUSHARE_SEED fixes the seed (default 20241)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """Sizes of the reliability scenarios."""

    soak: bool
    seed: int
    stateful_examples: int
    stateful_steps: int
    fuzz_examples: int
    burst_pods: int
    crash_rounds: int
    throttle_pods: int  # slow / throttling apiserver: pods of the burst (1-2 GiB each; the stack holds 64 GiB)
    throttle_seconds: float  # ... and how long the apiserver stays slow and throttling (pods arrive in the 1st half)
    scale_nodes: int  # node agents at scale: agent processes (one per simulated node, 4 GPUs of 16 GiB each)
    scale_pods: int  # ... and the burst of 1-2 GiB pods they receive


def current() -> Profile:
    """The profile selected by the environment."""
    soak = os.environ.get("GPUSHARE_SOAK", "") not in ("", "0", "false")
    seed = int(os.environ.get("GPUSHARE_SEED", "20241"))
    if soak:
        return Profile(
            soak=True,
            seed=seed,
            stateful_examples=300,
            stateful_steps=60,
            fuzz_examples=5000,
            burst_pods=400,
            crash_rounds=6,
            throttle_pods=45,
            throttle_seconds=120.0,
            scale_nodes=40,
            scale_pods=1000,
        )
    return Profile(
        soak=False,
        seed=seed,
        stateful_examples=25,
        stateful_steps=20,
        fuzz_examples=150,
        burst_pods=40,
        crash_rounds=1,
        throttle_pods=30,
        throttle_seconds=20.0,
        scale_nodes=8,
        scale_pods=160,
    )


PROFILE = current()
