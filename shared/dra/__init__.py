"""gpushare on Kubernetes' Dynamic Resource Allocation (`resource.k8s.io/v1`): the pure core (no I/O).

Names both sides agree on (the node agent that publishes the ResourceSlice and prepares claims, the binder
that records allocations in the ledger before kube-scheduler binds the pod), the slice a node publishes
(`slices`), what an allocated claim means for the ledger (`claims`), the claim status the binder writes
(`conditions`) and the CDI spec the node agent writes (`cdi`). Every field rule was read from the v1.37.2
sources (docs/dra.md).
"""

from __future__ import annotations

DRIVER = "gpu.gpushare.io"
"""The driver name (ResourceSlice `spec.driver`, allocation results' `driver`; a DNS subdomain)."""

DEVICE_CLASS = "gpushare-gpu"
"""The DeviceClass whose requests the gpushare driver serves."""

MEMORY = "memory"
COMPUTE = "compute"
"""The two consumable capacities of a GPU device (claims ask for them under the same names)."""

RESERVED_CONDITION = "gpushare.io/LedgerReserved"
REFUSED_CONDITION = "gpushare.io/LedgerRefused"
"""The binding condition (the ledger recorded the allocation) and the binding failure condition (it refused)."""

UNHEALTHY_TAINT = "gpushare.io/unhealthy"
"""The device taint of an unhealthy GPU (effect NoSchedule: no new allocations, running pods stay)."""

CLAIM_ANNOTATION = "gpushare.io/claim"
"""Pod annotation the binder writes beside `gpushare.io/allocation` for a DRA allocation: the claim's UID (its
allocation is adopted through the claim, never through the annotation)."""

PLUGIN_NAME = DRIVER
REGISTRATION_DIR = "/var/lib/kubelet/plugins_registry"
PLUGIN_DIR = f"/var/lib/kubelet/plugins/{DRIVER}"
CDI_DIR = "/var/run/cdi"
"""Where kubelet looks for plugin registration sockets, where the plugin's own socket lives, where CDI specs go."""
