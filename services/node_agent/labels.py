"""Node labels describing the GPUs (pure), so nodeSelectors and affinities can target GPU kinds."""

from __future__ import annotations

import re
from collections import Counter

from services.node_agent.discovery import GpuDevice

PREFIX = "gpushare.io/"
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_JOIN_NEXT = {"rtx", "gtx", "titan"}


def label_value(text: str) -> str:
    """A valid label value: [A-Za-z0-9._-], at most 63 characters, alphanumeric at both ends."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63].strip("-._")
    return value


def short_type(model: str) -> str:
    """A short GPU type from a model name: `Tesla-T4` -> `t4`, `NVIDIA A100-SXM4-80GB` -> `a100`,
    `NVIDIA GeForce RTX 4090` -> `rtx4090`."""
    words = [w for w in re.split(r"[\s_\-]+", model.lower()) if w and w not in _VENDOR_WORDS]
    if not words:
        return "unknown"
    if words[0] in _JOIN_NEXT and len(words) > 1:
        return label_value(words[0] + words[1])
    return label_value(words[0]) or "unknown"


def node_labels(
    gpus: list[GpuDevice], driver: str, cuda: str, *, type_label_key: str, schedulable_mib: dict[str, int]
) -> dict[str, str]:
    """Labels for a node with these GPUs. Heterogeneous nodes get `mixed` in the single-valued labels and
    one `gpushare.io/model.<model>: <count>` label per model."""
    models = Counter(g.model for g in gpus)
    mems = {schedulable_mib.get(g.uuid, 0) for g in gpus}
    types = {short_type(g.model) for g in gpus}
    labels = {
        f"{PREFIX}gpu-count": str(len(gpus)),
        f"{PREFIX}gpu-model": label_value(next(iter(models))) if len(models) == 1 else "mixed",
        f"{PREFIX}gpu-memory-mib": str(next(iter(mems))) if len(mems) == 1 else "mixed",
        f"{PREFIX}driver-version": label_value(driver),
        f"{PREFIX}cuda-version": label_value(cuda),
    }
    for model, count in models.items():
        key = label_value(model.lower())[: 63 - len("model.")].strip("-._")
        if key:
            labels[f"{PREFIX}model.{key}"] = str(count)
    if type_label_key:
        labels[type_label_key] = next(iter(types)) if len(types) == 1 else "mixed"
    return labels
