"""One release number: pyproject.toml's version is the chart's `version` and `appVersion`, the image tag both the
chart and the kustomize tree install, the migration Job's name, `gpushare --version`, and the newest entry of
CHANGELOG.md (docs/install.md, "Versions")."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from typing import Any

import yaml

from services.cli import version
from tests.deploy.chart import CHART
from tests.deploy.tools import MIGRATE_JOB, ROOT, VERSION, find, pod_spec

SEMVER = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?$")


def test_the_release_is_a_semantic_version() -> None:
    assert SEMVER.match(VERSION), VERSION


def test_the_chart_is_the_release() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == VERSION
    assert chart["appVersion"] == VERSION


def test_the_kustomize_tree_installs_the_release(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, objects in rendered.items():  # an overlay's own workloads (overlays/dra's node agent) name it too
        images = {c["image"] for o in objects if (spec := pod_spec(o)) for c in spec["containers"]}
        assert f"ghcr.io/gpushare/gpushare:{VERSION}" in images, name
        ours = {i for i in images if i.split("@")[0].split(":")[0].rsplit("/", 1)[-1] == "gpushare"}
        assert ours == {f"ghcr.io/gpushare/gpushare:{VERSION}"}, f"{name}: {ours}"
    objects = rendered["base"]
    job = find(objects, "Job", MIGRATE_JOB)
    assert pod_spec(job)["containers"][0]["image"].endswith(f":{VERSION}")


def test_gpushare_version_says_the_release() -> None:
    assert metadata.version("gpushare") == VERSION, "reinstall the package (make install) after a version change"
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.startswith(f"gpushare {VERSION}")
    assert version().startswith(f"gpushare {VERSION}")


def test_the_changelog_starts_with_the_release_and_says_how_to_upgrade() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[?(\d+\.\d+\.\d+[^\]\s]*)\]?", text, re.MULTILINE)
    assert releases and releases[0] == VERSION, releases
    newest = text.split(f"## {VERSION}", 1)[1].split("\n## ", 1)[0]
    assert "### Upgrading" in newest, "every release says how to upgrade to it"
