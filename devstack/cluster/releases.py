"""Which Kubernetes release the local control plane runs, and how each one is obtained.

The current release (the default) is built from the Go module `k8s.io/kubernetes` with the machine's Go; the
1.20 compatibility release from Debian's `kubernetes` source package with Debian's Go 1.19. Pick one with
`GPUSHARE_K8S_VERSION`: `current` (default), `1.20`, or an exact `v1.N.P` that the Go module proxy serves.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

CURRENT_VERSION = "v1.37.2"
COMPAT_VERSION = "v1.20.2"
VERSION_ENV = "GPUSHARE_K8S_VERSION"
ALIASES = {"current": CURRENT_VERSION, "compat": COMPAT_VERSION, "1.20": COMPAT_VERSION}
_VERSION_RE = re.compile(r"^v?1\.(\d+)\.(\d+)$")


@dataclass(frozen=True)
class Release:
    """One Kubernetes release the dev control plane can run."""

    version: str  # "v1.37.2"

    @property
    def minor(self) -> int:
        """The minor version number (37 for v1.37.2)."""
        return int(self.version.split(".")[1])

    @property
    def from_debian_source(self) -> bool:
        """True for 1.20, which Debian ships as source; later ones come from the Go module proxy."""
        return self.minor == 20

    @property
    def scheduler_api_version(self) -> str:
        """The KubeSchedulerConfiguration API group version this release reads."""
        if self.minor >= 25:
            return "kubescheduler.config.k8s.io/v1"
        if self.minor >= 23:
            return "kubescheduler.config.k8s.io/v1beta3"
        return "kubescheduler.config.k8s.io/v1beta1"

    @property
    def has_insecure_port_flags(self) -> bool:
        """Whether `--insecure-port` / `--port` still exist (removed in 1.24)."""
        return self.minor < 24

    def __str__(self) -> str:
        return self.version


def parse_release(text: str) -> Release:
    """A Release from `current`, `1.20`, `v1.37.2` or `1.37.2`; ValueError naming the accepted forms."""
    raw = text.strip()
    version = ALIASES.get(raw.lower(), raw)
    match = _VERSION_RE.match(version)
    if not match:
        raise ValueError(f"{VERSION_ENV}={text!r}: expected 'current', '1.20' or an exact version like v1.37.2")
    minor = int(match.group(1))
    if minor != 20 and minor < 30:
        raise ValueError(
            f"{VERSION_ENV}={text!r}: releases 1.30 and later are built from Go modules, and 1.20 "
            "from Debian's source; others are not supported"
        )
    return Release(f"v1.{minor}.{match.group(2)}")


def selected_release(env: Mapping[str, str] | None = None) -> Release:
    """The release `GPUSHARE_K8S_VERSION` names (the current one when unset)."""
    value = (env if env is not None else os.environ).get(VERSION_ENV, "").strip()
    return parse_release(value or "current")


CURRENT = Release(CURRENT_VERSION)
COMPAT = Release(COMPAT_VERSION)
