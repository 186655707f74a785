"""Which JetStream stream keeps which event kinds, and the limits each stream carries.

Every event is published on `<prefix>.<kind>.<node>`; two streams split that subject space by kind:

* the **ledger stream** (`GPUSHARE`): every kind that changes a ledger table (inventory, node_retired,
  health, quota, reserved, bound, failed, assigned, exchanged, terminating, released). Replaying it, from
  the newest ledger snapshot on, reproduces the ledger, so it has no age limit by default: the snapshot
  job removes what a stored snapshot covers (`shared.ledger.snapshots`).
* the **samples stream** (`GPUSHARE_SAMPLES`): `usage`, `refused` and `unallocated` (a pod using a GPU it
  holds no share on). They change no ledger row, only accounting's read models and alerts, and arrive every
  few seconds per node, so the stream keeps them for an age (24 h by default) and accounting keeps what it
  projected from them.

Health stays in the ledger stream although it is sampled: a health event sets `gpus.healthy`, so a rebuild
needs it. A kind added to the catalogue lands in the ledger stream unless it is listed here as a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.events.catalogue import EVENT_KINDS, RefusedEvent, UnallocatedUseEvent, UsageEvent, kind_of

if TYPE_CHECKING:
    from shared.settings import Settings

SAMPLE_KINDS: frozenset[str] = frozenset({kind_of(UsageEvent), kind_of(RefusedEvent), kind_of(UnallocatedUseEvent)})
LEDGER_KINDS: tuple[str, ...] = tuple(k for k in EVENT_KINDS if k not in SAMPLE_KINDS)

DAY_S = 86_400.0


@dataclass(frozen=True)
class StreamLimits:
    """How much each stream keeps (0 means no limit of that kind)."""

    samples_max_age_s: float = DAY_S
    samples_max_bytes: int = 0
    ledger_max_age_s: float = 0.0
    ledger_max_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("samples_max_age_s", "samples_max_bytes", "ledger_max_age_s", "ledger_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        for name in ("samples_max_age_s", "ledger_max_age_s"):
            if 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be 0 (no limit) or at least one second")

    @classmethod
    def from_settings(cls, settings: Settings) -> StreamLimits:
        """The limits a process was configured with (`GPUSHARE_SAMPLES_MAX_AGE`, ...)."""
        return cls(
            samples_max_age_s=settings.samples_max_age,
            samples_max_bytes=settings.samples_max_bytes,
            ledger_max_age_s=settings.ledger_max_age,
            ledger_max_bytes=settings.ledger_max_bytes,
        )

    def age_and_bytes(self, samples: bool) -> tuple[float, int]:
        """(max age in seconds, max bytes) of the samples stream or of the ledger stream."""
        if samples:
            return self.samples_max_age_s, self.samples_max_bytes
        return self.ledger_max_age_s, self.ledger_max_bytes
