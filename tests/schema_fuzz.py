"""What the schemathesis tests share: hypothesis settings for fuzzing a live server."""

from __future__ import annotations

import hypothesis
from hypothesis import HealthCheck


def live_server_settings(examples: int) -> hypothesis.settings:
    """Repeatable (derandomized), no deadline (a real server over HTTP), no example database, no health checks."""
    return hypothesis.settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
