"""Steering annotations a pod may carry: GPU model / UUID include and exclude, minimum CUDA, policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from shared import annotations as ann


class Policy(StrEnum):
    """How to choose among nodes and GPUs that fit."""

    BINPACK = "binpack"
    SPREAD = "spread"


class HintError(ValueError):
    """An annotation value that cannot be understood."""


@dataclass(frozen=True, slots=True)
class Hints:
    """Parsed steering annotations (empty tuples mean "no constraint")."""

    model_include: tuple[str, ...] = ()
    model_exclude: tuple[str, ...] = ()
    uuid_include: frozenset[str] = frozenset()
    uuid_exclude: frozenset[str] = frozenset()
    min_cuda: tuple[int, ...] | None = None
    policy: Policy | None = None

    @property
    def constrains_gpus(self) -> bool:
        """True when some GPU may be excluded by these hints."""
        return bool(self.model_include or self.model_exclude or self.uuid_include or self.uuid_exclude)

    def gpu_allowed(self, uuid: str, model: str) -> bool:
        """Whether a GPU passes the model and UUID hints (models match as case-insensitive substrings)."""
        if self.uuid_include and uuid not in self.uuid_include:
            return False
        if uuid in self.uuid_exclude:
            return False
        low = model.lower()
        if self.model_include and not any(m in low for m in self.model_include):
            return False
        return not any(m in low for m in self.model_exclude)

    def describe(self) -> str:
        """A short human description of the GPU constraints, for refusal reasons."""
        bits = []
        if self.model_include:
            bits.append(f"model in {list(self.model_include)}")
        if self.model_exclude:
            bits.append(f"model not in {list(self.model_exclude)}")
        if self.uuid_include:
            bits.append(f"UUID in {sorted(self.uuid_include)}")
        if self.uuid_exclude:
            bits.append(f"UUID not in {sorted(self.uuid_exclude)}")
        return ", ".join(bits)


def _items(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_version(value: str) -> tuple[int, ...]:
    """'12.2' -> (12, 2); raises HintError for anything else."""
    try:
        parts = tuple(int(p) for p in value.strip().split("."))
    except ValueError:
        raise HintError(f"not a version number: {value!r}") from None
    if not parts or any(p < 0 for p in parts):
        raise HintError(f"not a version number: {value!r}")
    return parts


def parse_hints(annotations: Mapping[str, object] | None) -> Hints:
    """Read the steering annotations of a pod; raises HintError naming a bad value."""
    if not annotations:
        return Hints()

    def get(key: str) -> str:
        value = annotations.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise HintError(f"annotation {key} must be a string")
        return value

    policy_raw = get(ann.POLICY).strip().lower()
    policy = None
    if policy_raw:
        try:
            policy = Policy(policy_raw)
        except ValueError:
            raise HintError(f"annotation {ann.POLICY} must be binpack or spread, not {policy_raw!r}") from None
    cuda_raw = get(ann.MIN_CUDA_VERSION).strip()
    min_cuda = None
    if cuda_raw:
        try:
            min_cuda = parse_version(cuda_raw)
        except HintError as exc:
            raise HintError(f"annotation {ann.MIN_CUDA_VERSION}: {exc}") from None
    return Hints(
        model_include=tuple(m.lower() for m in _items(get(ann.GPU_MODEL_INCLUDE))),
        model_exclude=tuple(m.lower() for m in _items(get(ann.GPU_MODEL_EXCLUDE))),
        uuid_include=frozenset(_items(get(ann.GPU_UUID_INCLUDE))),
        uuid_exclude=frozenset(_items(get(ann.GPU_UUID_EXCLUDE))),
        min_cuda=min_cuda,
        policy=policy,
    )
