"""gpushare's steering annotations as CEL selectors on the gpushare slice's device attributes (pure).

The extender applies the annotations of `shared.placement.hints` to the GPUs it knows; on DRA nodes kube-scheduler
chooses the device, so the admission webhook writes the same constraints into the claim request as CEL selectors
over the attributes the node agent publishes (`shared.dra.slices.gpu_device`):

* `gpushare.io/gpu-model-include` / `-exclude`: case-insensitive substrings of `model`
  (`attrs.model.lowerAscii().contains("a100")`, as `Hints.gpu_allowed` matches);
* `gpushare.io/gpu-uuid-include` / `-exclude`: `uuid` in / not in the list;
* `gpushare.io/min-cuda-version`: the device has a `cudaVersion` and it is at least the minimum
  (`compareTo(semver("12.2.0")) >= 0`); a GPU that reports no CUDA version is refused, as the extender refuses a
  node without one.

Facts from v1.37.2: a device's attributes are `device.attributes["<driver>"].<name>`; an unknown domain is an empty
map, but an unknown attribute is a runtime error that fails the allocation (`DeviceMatches`,
`dynamic-resource-allocation/cel/compile.go`), hence the `in` guard; `lowerAscii` (cel-go strings extension) and
`semver`/`compareTo` (`library.SemverLib`, in the base environment since 1.33) are available
(`apiserver/pkg/cel/environment/base.go`); an expression is at most 10 KiB (`CELSelectorExpressionMaxLength`), a
request holds at most 32 selectors (`DeviceSelectorsMaxSize`).
"""

from __future__ import annotations

import json

from shared.dra import DRIVER
from shared.placement.hints import Hints, Policy

MAX_EXPRESSION_LENGTH = 10 * 1024
ATTRIBUTES = f'device.attributes["{DRIVER}"]'


class SelectorError(ValueError):
    """Hints that no CEL selector can carry (the message says why and what to write instead)."""


def _literal(text: str) -> str:
    """A CEL string literal (JSON's double-quoted escapes are CEL's: `\\"`, `\\\\`, `\\n`, `\\uXXXX`)."""
    return json.dumps(text)


def semver_text(version: tuple[int, ...]) -> str:
    """A parsed version as the semantic version CEL compares (`(12, 2)` -> `12.2.0`); SelectorError for more than
    three parts (a semantic version has major, minor and patch only)."""
    if len(version) > 3:
        raise SelectorError(
            f"minimum CUDA version {'.'.join(map(str, version))} has more than three parts; DRA compares semantic "
            "versions (major.minor.patch): write at most three, e.g. 12.2"
        )
    return ".".join(str(p) for p in (*version, 0, 0)[:3])


def _any_model(models: tuple[str, ...]) -> str:
    return " || ".join(f"{ATTRIBUTES}.model.lowerAscii().contains({_literal(m)})" for m in models)


def _uuid_list(uuids: frozenset[str]) -> str:
    return "[" + ", ".join(_literal(u) for u in sorted(uuids)) + "]"


def hint_selectors(hints: Hints) -> list[dict[str, dict[str, str]]]:
    """The request's `selectors` for a pod's hints ([] without any); SelectorError when one cannot be written."""
    expressions = []
    if hints.model_include:
        expressions.append(_any_model(hints.model_include))
    if hints.model_exclude:
        expressions.append(f"!({_any_model(hints.model_exclude)})")
    if hints.uuid_include:
        expressions.append(f"{ATTRIBUTES}.uuid in {_uuid_list(hints.uuid_include)}")
    if hints.uuid_exclude:
        expressions.append(f"!({ATTRIBUTES}.uuid in {_uuid_list(hints.uuid_exclude)})")
    if hints.min_cuda is not None:
        version = semver_text(hints.min_cuda)
        expressions.append(
            f'"cudaVersion" in {ATTRIBUTES} && {ATTRIBUTES}.cudaVersion.compareTo(semver({_literal(version)})) >= 0'
        )
    for expression in expressions:
        if len(expression.encode()) > MAX_EXPRESSION_LENGTH:
            raise SelectorError(
                f"the GPU hints make a CEL selector of {len(expression.encode())} bytes, more than DRA's "
                f"{MAX_EXPRESSION_LENGTH}; list fewer GPU UUIDs or models (or steer with a node selector)"
            )
    return [{"cel": {"expression": e}} for e in expressions]


def policy_warning(hints: Hints) -> str | None:
    """A warning for a placement policy DRA does not honour (None when there is nothing to say)."""
    if hints.policy is Policy.SPREAD:
        return (
            "gpushare.io/policy=spread is not applied on DRA nodes: kube-scheduler takes the first GPU that fits, "
            "in the slice's index order (which packs); spread the pods with topologySpreadConstraints or "
            "podAntiAffinity instead"
        )
    return None
