"""`gpushare scheduler-config --from-policy FILE`: the KubeSchedulerConfiguration equivalent to a legacy scheduler
Policy (`--policy-config-file`, the gpushare deployment guide's scheduler-policy-config.json), for the release it
will run on.

kube-scheduler 1.23 removed the Policy API; its extenders moved into the configuration file (`--config`). The
extender fields are the same, spelled the same, except two: `enableHttps` becomes `enableHTTPS`, and
`httpTimeout`, nanoseconds in a Policy, becomes a duration string (`30s`). The configuration's API version
follows the release: `kubescheduler.config.k8s.io/v1beta1` on 1.19-1.21, `v1beta2` on 1.22, `v1beta3` on
1.23-1.24, `v1` from 1.25. What a Policy says besides its extenders (predicates, priorities, ...) has no
one-to-one equivalent: it is named in a note, never dropped silently. One thing is changed for gpushare's extender:
`ignoredByScheduler: true` on an `aliyun.com/` resource becomes false (with a note), since kube-scheduler never
preempts for a resource it does not count.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GROUP = "kubescheduler.config.k8s.io"
FIRST_MINOR = 19  # the first release with a KubeSchedulerConfiguration that holds extenders (v1beta1)
DEFAULT_KUBECONFIG = "/etc/kubernetes/scheduler.conf"
EXTENDER_FIELDS = {
    "urlPrefix": str,
    "filterVerb": str,
    "preemptVerb": str,
    "prioritizeVerb": str,
    "bindVerb": str,
    "weight": int,
    "enableHttps": bool,
    "tlsConfig": dict,
    "httpTimeout": int,
    "nodeCacheCapable": bool,
    "managedResources": list,
    "ignorable": bool,
}
"""A Policy extender's fields (k8s.io/kube-scheduler/config/v1 Extender, the Policy API) and their JSON types."""
TLS_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}
RENAMED = {"enableHttps": "enableHTTPS"}
GPUSHARE_VERBS = {"prioritizeVerb": "prioritize", "preemptVerb": "preempt"}
GPUSHARE_RESOURCE_PREFIX = "aliyun.com/"
OTHER_POLICY_FIELDS = {
    "predicates": "predicates select filter plugins: list the ones to keep under profiles[].plugins.filter",
    "priorities": "priorities select score plugins and weights: profiles[].plugins.score",
    "hardPodAffinitySymmetricWeight": "profiles[].pluginConfig InterPodAffinity args hardPodAffinityWeight",
    "alwaysCheckAllPredicates": "gone: kube-scheduler runs every filter plugin of a profile",
}


class PolicyError(ValueError):
    """A Policy that cannot be converted; the message names the field and says what was expected."""


@dataclass
class Converted:
    """The configuration as a dict, and notes for the person converting (things to do or know)."""

    config: dict[str, Any]
    api_version: str
    notes: list[str] = field(default_factory=list)


def api_version_for(release: str) -> str:
    """The KubeSchedulerConfiguration API version a kube-scheduler release reads (`1.20`, `v1.37.2`)."""
    match = re.fullmatch(r"v?1\.(\d+)(?:\.\d+)?", release.strip())
    if match is None:
        raise PolicyError(f"--kubernetes-version {release!r}: expected a release such as 1.20, 1.24 or v1.37.2")
    minor = int(match.group(1))
    if minor < FIRST_MINOR:
        raise PolicyError(
            f"kube-scheduler 1.{minor} reads the Policy itself (--policy-config-file): keep it there; a "
            "KubeSchedulerConfiguration with extenders needs 1.19 or later"
        )
    version = "v1" if minor >= 25 else "v1beta3" if minor >= 23 else "v1beta2" if minor == 22 else "v1beta1"
    return f"{GROUP}/{version}"


def go_duration(nanoseconds: int) -> str:
    """A Policy's nanoseconds as a duration kube-scheduler parses (Go's time.ParseDuration): `30s`, `500ms`."""
    for unit, size in (("s", 10**9), ("ms", 10**6), ("us", 10**3)):
        if nanoseconds % size == 0:
            return f"{nanoseconds // size}{unit}"
    return f"{nanoseconds}ns"


def _extender(raw: Any, where: str, notes: list[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: an extender is a JSON object, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(EXTENDER_FIELDS))
    if unknown:
        raise PolicyError(
            f"{where}: unknown field(s) {', '.join(unknown)} (a Policy extender has {', '.join(EXTENDER_FIELDS)})"
        )
    for name, kind in EXTENDER_FIELDS.items():
        value = raw.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            expected = "nanoseconds, e.g. 30000000000" if name == "httpTimeout" else kind.__name__
            raise PolicyError(f"{where}.{name}: {value!r} is not {expected}")
    if not raw.get("urlPrefix"):
        raise PolicyError(f"{where}.urlPrefix: required (the extender's base URL)")
    if raw.get("prioritizeVerb") and int(raw.get("weight") or 0) <= 0:
        raise PolicyError(f"{where}.weight: a positive weight is needed with prioritizeVerb (gpushare ships 5)")
    if raw.get("httpTimeout") is not None and raw["httpTimeout"] <= 0:
        raise PolicyError(f"{where}.httpTimeout: {raw['httpTimeout']} is not a positive number of nanoseconds")
    tls = raw.get("tlsConfig")
    if tls is not None and set(tls) - TLS_FIELDS:
        raise PolicyError(f"{where}.tlsConfig: unknown field(s) {', '.join(sorted(set(tls) - TLS_FIELDS))}")
    out: dict[str, Any] = {}
    for name in EXTENDER_FIELDS:  # kube-scheduler's own field order
        if name not in raw:
            continue
        value = raw[name]
        if name == "httpTimeout":
            value = go_duration(value)
        elif name == "managedResources":
            value = [_managed(r, f"{where}.managedResources[{i}]") for i, r in enumerate(value)]
        out[RENAMED.get(name, name)] = value
    if "gpushare-scheduler" in out["urlPrefix"]:
        missing = [f"{verb}: {value}" for verb, value in GPUSHARE_VERBS.items() if not out.get(verb)]
        if missing:
            notes.append(
                f"{where} calls gpushare's extender without {' and '.join(missing)}: it answers those too "
                "(GPU-aware scoring and preemption); add them, with a weight, to gain them"
            )
        if "httpTimeout" not in out:
            notes.append(
                f"{where} has no httpTimeout: kube-scheduler's default is 5s; gpushare's bind may take up to 30s"
            )
        counted = _count_gpushare_resources(out.get("managedResources") or [])
        if counted:
            notes.append(
                f"{where}.managedResources: {', '.join(counted)} had ignoredByScheduler: true, written as false: "
                "kube-scheduler must count them per node itself (as kubelet does at admission) to preempt for them "
                "at all (docs/extender.md, Preemption)"
            )
    return out


def _count_gpushare_resources(managed: list[dict[str, Any]]) -> list[str]:
    """Turn `ignoredByScheduler: true` into false on gpushare's resources (in place); the names changed.

    With `true` kube-scheduler's NodeResourcesFit skips the resource, so its preemption finds no shortage to relieve
    and reprieves every victim ("preemption: expected at least one victim pod on node"): GPU pods never preempt."""
    changed = []
    for resource in managed:
        if resource["name"].startswith(GPUSHARE_RESOURCE_PREFIX) and resource.get("ignoredByScheduler"):
            resource["ignoredByScheduler"] = False
            changed.append(resource["name"])
    return changed


def _managed(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise PolicyError(f'{where}: expected {{"name": "aliyun.com/gpu-mem", "ignoredByScheduler": false}}')
    if set(raw) - {"name", "ignoredByScheduler"}:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(sorted(set(raw) - {'name', 'ignoredByScheduler'}))}")
    if not isinstance(raw.get("ignoredByScheduler", False), bool):
        raise PolicyError(f"{where}.ignoredByScheduler: {raw['ignoredByScheduler']!r} is not true or false")
    return dict(raw)


def convert(policy: Any, release: str, *, kubeconfig: str = DEFAULT_KUBECONFIG, leader_elect: bool = True) -> Converted:
    """The KubeSchedulerConfiguration for `release` equivalent to `policy` (a decoded Policy); PolicyError names
    what cannot be converted."""
    api_version = api_version_for(release)
    if not isinstance(policy, dict):
        raise PolicyError("a scheduler Policy is a JSON object with kind: Policy")
    if (policy.get("kind"), policy.get("apiVersion")) != ("Policy", "v1"):
        raise PolicyError(
            f"not a scheduler Policy: kind {policy.get('kind')!r}, apiVersion {policy.get('apiVersion')!r} "
            "(expected kind: Policy, apiVersion: v1)"
        )
    extenders = policy.get("extenders")
    if not isinstance(extenders, list) or not extenders:
        raise PolicyError("the Policy has no extenders: nothing of it needs a configuration file")
    notes: list[str] = []
    converted = [_extender(e, f"extenders[{i}]", notes) for i, e in enumerate(extenders)]
    for name in sorted(set(policy) - {"kind", "apiVersion", "extenders"}):
        hint = OTHER_POLICY_FIELDS.get(name, "no equivalent known to this tool")
        notes.append(f"the Policy's {name} is not converted (the default profile's plugins run): {hint}")
    config = {
        "apiVersion": api_version,
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "leaderElection": {"leaderElect": leader_elect},
        "extenders": converted,
    }
    return Converted(config, api_version, notes)


def render(result: Converted, source: str, release: str) -> str:
    """The configuration as YAML, with a header saying what it is and how kube-scheduler takes it."""
    head = [
        f"# kube-scheduler {release}: pass with --config=<this file> instead of --policy-config-file",
        f"# (converted by `gpushare scheduler-config` from {source}).",
    ]
    head += [f"# NOTE: {n}" for n in result.notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(result.config, sort_keys=False, default_flow_style=False)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the `scheduler-config` subcommand (`common` is not taken: it needs no database, bus or unit)."""
    p = subparsers.add_parser(  # no common settings: it reads a file and writes one
        "scheduler-config",
        help="convert a scheduler Policy (--policy-config-file) into a KubeSchedulerConfiguration",
        description="Print the KubeSchedulerConfiguration equivalent to a legacy scheduler Policy (the gpushare "
        "guide's scheduler-policy-config.json), in the API version the target kube-scheduler reads: v1beta1 for "
        "1.19-1.21, v1beta2 for 1.22, v1beta3 for 1.23-1.24, v1 from 1.25. kube-scheduler 1.23 removed Policy "
        "files. For gpushare's extender, ignoredByScheduler: true on an aliyun.com/ resource becomes false (without "
        "it kube-scheduler never preempts for GPU shares). Notes (what was not converted or was changed, verbs "
        "gpushare adds) go to stderr and into the file's header.",
    )
    p.add_argument("--from-policy", metavar="FILE", required=True, help="the Policy JSON file (- reads stdin)")
    p.add_argument(
        "--kubernetes-version",
        metavar="RELEASE",
        default="1.25",
        help="the kube-scheduler release that will read the file, e.g. 1.20, 1.24, v1.37.2 (default: 1.25 and "
        "later, API version v1)",
    )
    p.add_argument(
        "--kubeconfig",
        default=DEFAULT_KUBECONFIG,
        help=f"clientConnection.kubeconfig of the configuration (default {DEFAULT_KUBECONFIG}, kubeadm's)",
    )
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write the configuration here (default stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Any) -> int:
    """Entry point of `gpushare scheduler-config`: 0 converted, 2 when the Policy cannot be converted."""
    source = "stdin" if args.from_policy == "-" else args.from_policy
    try:
        text = sys.stdin.read() if args.from_policy == "-" else Path(args.from_policy).read_text()
    except OSError as exc:
        print(f"gpushare scheduler-config: cannot read {source}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        policy = json.loads(text)
    except ValueError as exc:
        print(f"gpushare scheduler-config: {source} is not JSON: {exc}", file=sys.stderr)
        return 2
    try:
        result = convert(policy, args.kubernetes_version, kubeconfig=args.kubeconfig)
    except PolicyError as exc:
        print(f"gpushare scheduler-config: {source}: {exc}", file=sys.stderr)
        return 2
    out = render(result, source, args.kubernetes_version)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(out)
        print(f"wrote {args.output} ({result.api_version})", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0
