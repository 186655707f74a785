"""The real-chart tier: the chart installed with `helm install` into the local control plane with a real node
(kubelet v1.37.2, containerd, runc), every part a pod of images built here. Skipped with the reason, as the
real-node tier is (tests/realnode/conftest.py), where the machine cannot run containers or build the images."""

from __future__ import annotations

from tests.realnode.conftest import real_node_reason  # noqa: F401  (the real-node tier's reason, once per session)
