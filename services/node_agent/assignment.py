"""Pure core of exact device assignment: which pending container a kubelet device set belongs to.

kubelet's `Allocate` carries no pod identity, only device IDs (`<GPU-UUID>-_-<j>`, one per memory unit).
The agent knows, from the ledger, every container on its node that holds GPU shares and has not yet been
handed its GPU. This module decides, without I/O:

* which device IDs to prefer for a request of N units (`preferred_devices`): those on the GPU(s) of the
  oldest pending container of that size, so that kubelet's pick names the reserved GPUs;
* which pending container an `Allocate(device IDs)` is for (`match_container`): the oldest unclaimed one
  whose per-GPU unit counts equal the device set's; none -> the call is refused, never guessed;
* the container environment (`container_env`).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from shared.settings import MemoryUnit

ID_SEPARATOR = "-_-"


class AssignmentError(Exception):
    """A device set that cannot be mapped to a reserved container with certainty."""


@dataclass(frozen=True)
class Share:
    """A container's share of one GPU (memory in MiB)."""

    gpu_uuid: str
    gpu_index: int
    memory_mib: int
    compute: int = 0


@dataclass(frozen=True)
class PendingContainer:
    """A container of a live allocation on this node, with its GPU shares."""

    allocation_id: uuid.UUID
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    container_index: int
    init: bool
    shares: tuple[Share, ...]
    reserved_at: datetime
    assigned: bool = False
    pod_memory_mib: int = 0
    pod_created_at: datetime | None = None
    bound_at: datetime | None = None  # when the binder recorded the pod's Binding (None: not bound yet)

    @property
    def admission_order(self) -> tuple[int, datetime, datetime]:
        """When kubelet will admit this container's pod relative to others. kubelet sees a pod once it is bound,
        and admits the pods it receives together by creation time (kept to the second); pods arrive in the
        order they were bound. So: bound pods first, then by creation time, then by binding time."""
        bound = self.bound_at is not None
        return (0 if bound else 1, self.pod_created_at or self.reserved_at, self.bound_at or self.reserved_at)

    sidecar: bool = False

    @property
    def kind(self) -> tuple[bool, bool]:
        """(init, sidecar): only containers of the same kind are exchanged (their charges follow other rules)."""
        return (self.init, self.sidecar)

    @property
    def regular_init(self) -> bool:
        """An init container without `restartPolicy: Always`: it runs to completion before the next container
        starts, kubelet hands its devices on to the containers after it, and kubelet's pod-resources API never lists
        it."""
        return self.init and not self.sidecar

    @property
    def long_running(self) -> bool:
        """An app container or a sidecar: it holds its share for the pod's whole life."""
        return not self.init or self.sidecar

    @property
    def key(self) -> tuple[uuid.UUID, str]:
        """(allocation id, container name): how the ledger names a container."""
        return (self.allocation_id, self.container)

    def units(self, unit: MemoryUnit) -> Counter[str]:
        """Memory units per GPU UUID (what kubelet's device IDs count)."""
        return Counter({s.gpu_uuid: s.memory_mib // unit.mib for s in self.shares if s.memory_mib // unit.mib > 0})

    def total_units(self, unit: MemoryUnit) -> int:
        """All memory units this container holds."""
        return sum(self.units(unit).values())

    def share_shape(self) -> tuple[tuple[int, int], ...]:
        """Its share sizes (memory, compute) in GPU-index order: what its GPUs, its limits and its charges
        depend on. Two containers of equal share shape and kind can trade GPUs without any GPU holding more."""
        return tuple((s.memory_mib, s.compute) for s in sorted(self.shares, key=lambda s: s.gpu_index))

    def shape(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """The share shape plus its pod's total memory (`ALIYUN_COM_GPU_MEM_POD`): containers of equal shape
        can be exchanged without any variable of their environments (handed out at Allocate, before the agent
        knows the pod) becoming wrong."""
        return (self.pod_memory_mib, self.share_shape())


def device_id(gpu_uuid: str, j: int) -> str:
    """The gpu-mem device ID of unit `j` of a GPU (gpushare's format)."""
    return f"{gpu_uuid}{ID_SEPARATOR}{j}"


def gpu_of(device: str) -> str:
    """The GPU UUID a gpu-mem device ID belongs to; ValueError for foreign IDs."""
    gpu, sep, j = device.rpartition(ID_SEPARATOR)
    if not sep or not gpu or not j.isdigit():
        raise ValueError(f"not a gpushare gpu-mem device ID: {device!r}")
    return gpu


def units_by_gpu(device_ids: Iterable[str]) -> Counter[str]:
    """Device IDs counted per GPU UUID."""
    return Counter(gpu_of(d) for d in device_ids)


def _order(c: PendingContainer) -> tuple[tuple[int, datetime, datetime], str, bool, int]:
    # kubelet's admission order first; within a pod, init containers first, then by container index
    return (c.admission_order, str(c.allocation_id), not c.init, c.container_index)


def candidates(
    pending: Sequence[PendingContainer],
    claimed: set[tuple[uuid.UUID, str]],
    size: int,
    unit: MemoryUnit,
    prefer: uuid.UUID | None = None,
) -> list[PendingContainer]:
    """Unassigned, unclaimed containers holding exactly `size` units, in kubelet's admission order; those of the
    allocation `prefer` first (the pod whose init container's devices kubelet is handing on)."""
    return sorted(
        (c for c in pending if not c.assigned and c.key not in claimed and c.total_units(unit) == size),
        key=lambda c: (c.allocation_id != prefer, _order(c)),
    )


def preferred_devices(
    pending: Sequence[PendingContainer],
    claimed: set[tuple[uuid.UUID, str]],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    unit: MemoryUnit,
    prefer: uuid.UUID | None = None,
) -> list[str]:
    """Device IDs to prefer for a request of `size` units (may be empty: kubelet then picks).

    The first pending container of that size whose per-GPU units are all available wins (see `candidates` for
    `prefer`).
    """
    by_gpu: dict[str, list[str]] = {}
    for d in available:
        try:
            by_gpu.setdefault(gpu_of(d), []).append(d)
        except ValueError:
            continue
    must = list(must_include)
    must_units = units_by_gpu(must) if must else Counter()
    for c in candidates(pending, claimed, size, unit, prefer):
        want = c.units(unit)
        if any(must_units[g] > want.get(g, 0) for g in must_units):
            continue
        chosen: list[str] = list(must)
        ok = True
        for gpu, n in sorted(want.items()):
            extra = [d for d in by_gpu.get(gpu, []) if d not in must]
            need = n - must_units.get(gpu, 0)
            if len(extra) < need:
                ok = False
                break
            chosen.extend(extra[:need])
        if ok and len(chosen) == size:
            return chosen
    return []


def match_container(
    pending: Sequence[PendingContainer],
    claimed: set[tuple[uuid.UUID, str]],
    device_ids: Sequence[str],
    unit: MemoryUnit,
    prefer: uuid.UUID | None = None,
) -> PendingContainer:
    """The pending container an Allocate of `device_ids` is for; AssignmentError when none matches (see
    `candidates` for `prefer`)."""
    try:
        want = units_by_gpu(device_ids)
    except ValueError as exc:
        raise AssignmentError(str(exc)) from None
    size = sum(want.values())
    for c in candidates(pending, claimed, size, unit, prefer):
        if c.units(unit) == want:
            return c
    sizes = sorted({c.total_units(unit) for c in pending if not c.assigned and c.key not in claimed})
    detail = ", ".join(f"{g}: {n}" for g, n in sorted(want.items()))
    raise AssignmentError(
        f"no container reserved on this node waits for {size} {unit.value} on exactly these GPUs ({detail}); "
        f"pending container sizes: {sizes or 'none'}. Refusing rather than guessing a GPU: the pod must be "
        "placed by the gpushare scheduler extender (its ledger reservation is missing, released, or already assigned)"
    )


def container_env(
    c: PendingContainer,
    gpu_memory_mib: dict[str, int],
    gpu_total_mib: dict[str, int],
    unit: MemoryUnit,
    *,
    mps: bool,
) -> dict[str, str]:
    """The environment a container receives (gpushare's set plus gpushare.io limits / advice).

    `gpu_memory_mib` is each GPU's schedulable memory, `gpu_total_mib` its physical memory.
    """
    shares = sorted(c.shares, key=lambda s: s.gpu_index)
    uuids = [s.gpu_uuid for s in shares]
    container_units = sum(s.memory_mib for s in shares) // unit.mib
    first = shares[0].gpu_uuid
    fraction = min(
        (s.memory_mib / gpu_total_mib[s.gpu_uuid] for s in shares if gpu_total_mib.get(s.gpu_uuid)), default=1.0
    )
    fraction_text = f"{min(max(fraction, 0.0), 1.0):.4f}"
    env = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
        "ALIYUN_COM_GPU_MEM_IDX": ",".join(str(s.gpu_index) for s in shares),
        "ALIYUN_COM_GPU_MEM_POD": str(c.pod_memory_mib // unit.mib),
        "ALIYUN_COM_GPU_MEM_CONTAINER": str(container_units),
        "ALIYUN_COM_GPU_MEM_DEV": str(gpu_memory_mib.get(first, 0) // unit.mib),
        # No pod identity here (allocation id, pod UID, container name): Allocate cannot know which pod it
        # serves, and after an exchange the identity would name the other pod. Use the downward API for it.
        "GPUSHARE_GPU_MEMORY_MIB": ",".join(str(s.memory_mib) for s in shares),
        "GPUSHARE_GPU_MEMORY_FRACTION": fraction_text,
        # advisory: JAX/XLA preallocates this fraction of each visible GPU instead of 75 %
        "XLA_PYTHON_CLIENT_MEM_FRACTION": fraction_text,
    }
    if mps:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={s.memory_mib}M" for i, s in enumerate(shares))
        compute = min((s.compute for s in shares if s.compute > 0), default=0)
        if compute <= 0:
            compute = max(1, min(100, round(fraction * 100)))
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(compute)
    return env


DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts")
DEVICE_LIST_ROOT = "/var/run/nvidia-container-devices"


def device_list(env: dict[str, str], strategy: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """How a container is told its GPUs: `envvar` (NVIDIA_VISIBLE_DEVICES=<uuids>), or `volume-mounts` (one mount
    `/var/run/nvidia-container-devices/<uuid>` of /dev/null per GPU, and NVIDIA_VISIBLE_DEVICES naming that
    directory), which the NVIDIA container toolkit reads with `accept-nvidia-visible-devices-as-volume-mounts =
    true`. With `accept-nvidia-visible-devices-envvar-when-unprivileged = false` as well, the runtime then ignores
    a GPU list a pod writes into its own environment. Returns (env, [(container path, host path)])."""
    if strategy not in DEVICE_LIST_STRATEGIES:
        raise ValueError(f"device list strategy must be one of {DEVICE_LIST_STRATEGIES}, not {strategy!r}")
    devices = env.get("NVIDIA_VISIBLE_DEVICES")
    if strategy == "envvar" or not devices:
        return env, []
    mounts = [(f"{DEVICE_LIST_ROOT}/{uuid}", "/dev/null") for uuid in devices.split(",")]
    return {**env, "NVIDIA_VISIBLE_DEVICES": DEVICE_LIST_ROOT}, mounts
