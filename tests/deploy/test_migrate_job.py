"""The migration Job of the kustomize tree can run again: each release's `kubectl apply -k` creates its own Job.

A Job's pod template is immutable, so a Job that kept one name across releases made the next release's apply
fail ("field is immutable") until someone deleted the old Job by hand. The Job's name carries the release
(k8s/base/migrate-job.yaml), so the next release's apply creates a new Job beside the finished one, which
deletes itself after `ttlSecondsAfterFinished`. Shown against a real kube-apiserver: objects are created, not
dry-run.
"""

from __future__ import annotations

import copy
import subprocess
from typing import Any

import pytest
import yaml

from devstack.cluster import ControlPlane
from tests.deploy.tools import MIGRATE_JOB, VERSION, find

NAMESPACE = "gpushare-jobs"


def _kubectl(kubectl: str, cp: ControlPlane, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [kubectl, f"--kubeconfig={cp.kubeconfig_path}", "-n", NAMESPACE, *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, check=False)


def next_release(job: dict[str, Any], version: str) -> dict[str, Any]:
    """The Job as the tree of release `version` renders it: the release in its name and its image's tag."""
    out = copy.deepcopy(job)
    out["metadata"]["name"] = job["metadata"]["name"].replace(VERSION.replace(".", "-"), version.replace(".", "-"))
    container = out["spec"]["template"]["spec"]["containers"][0]
    container["image"] = container["image"].rsplit(":", 1)[0] + f":{version}"
    return out


@pytest.fixture(scope="module")
def job(kubectl: str, apiserver: ControlPlane, rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    created = _kubectl(kubectl, apiserver, "create", "namespace", NAMESPACE)
    assert created.returncode == 0 or "AlreadyExists" in created.stderr, created.stderr
    obj = copy.deepcopy(find(rendered["base"], "Job", MIGRATE_JOB))
    obj["metadata"]["namespace"] = NAMESPACE
    return obj


def test_the_next_release_applies_its_job_without_deleting_this_one(
    kubectl: str, apiserver: ControlPlane, job: dict[str, Any]
) -> None:
    for attempt in ("created", "unchanged"):
        applied = _kubectl(kubectl, apiserver, "apply", "-f", "-", stdin=yaml.safe_dump(job))
        assert applied.returncode == 0 and attempt in applied.stdout, applied.stdout + applied.stderr
    following = next_release(job, "99.0.0")
    pass
    applied = _kubectl(kubectl, apiserver, "apply", "-f", "-", stdin=yaml.safe_dump(following))
    assert applied.returncode == 0, f"the next release's migration Job was refused:\n{applied.stderr}"
    names = _kubectl(kubectl, apiserver, "get", "jobs", "-l", "app.kubernetes.io/name=gpushare-migrate", "-o", "name")
    assert set(names.stdout.split()) == {f"job.batch/{job['metadata']['name']}", "job.batch/gpushare-migrate-99-0-0"}
    assert job["spec"]["ttlSecondsAfterFinished"] == 600


def test_a_job_keeping_its_name_cannot_take_the_next_image(
    kubectl: str, apiserver: ControlPlane, job: dict[str, Any]
) -> None:
    """Why the name carries the release: Kubernetes refuses a changed pod template under the same name."""
    same_name = copy.deepcopy(job)
    same_name["metadata"]["name"] = "gpushare-migrate-fixed"
    assert _kubectl(kubectl, apiserver, "apply", "-f", "-", stdin=yaml.safe_dump(same_name)).returncode == 0
    same_name["spec"]["template"]["spec"]["containers"][0]["image"] += "-next"
    refused = _kubectl(kubectl, apiserver, "apply", "-f", "-", stdin=yaml.safe_dump(same_name))
    assert refused.returncode != 0 and "field is immutable" in refused.stderr, refused.stderr
