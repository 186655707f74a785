"""`gpushare node-agent --dra`: the node as a DRA node (the DRA plugin instead of the three device plugins).

The agent keeps discovery, inventory (now saying `allocator: dra`), health, usage and metrics. On top:

* the ResourceSlice (`shared.dra.slices`) is published once the ledger holds the inventory and kubelet registered
  the DRA plugin (kube-scheduler allocates on a slice at once, and kubelet fails the preparation of a claim whose
  driver it has not registered yet, trying again only at the pod's resync, about a minute later:
  pkg/kubelet/cm/dra/manager.go `GetPlugin`, pkg/kubelet/pod_workers.go), and written again on
  every inventory or health change with the pool generation raised (an unhealthy GPU gets its taint); the slice is
  owned by the Node, so it goes with it. A node labelled `gpushare.io/dra-gate=ledger` (a gated pool) publishes
  the ledger's binding conditions on its devices; the label is read at every pass (a minute at most), so moving a
  pool into or out of the gate needs no restart;
* the DRA plugin (`dra_plugin`) registers with kubelet and prepares claims (`dra_prepare`).

Everything Kubernetes-side is read and written as JSON through the API client (no generated models: the client's
models may predate the fields of `resource.k8s.io/v1` in 1.37).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.node_agent.dra_plugin import DraPluginServer, device_health
from services.node_agent.dra_prepare import ClaimPreparer
from shared.dra.slices import SliceError, gated, next_generation, resource_slice, slice_name, slice_spec
from shared.events.catalogue import GpuInfo
from shared.kube.raw import read_json
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

# how long the slice waits for kubelet's registration before the agent warns (kubelet's plugin watcher registers a
# socket within a second or two)
REGISTRATION_PATIENCE_S = 30.0


async def _read(call: Any, *args: Any) -> dict[str, Any] | None:
    """A GET through the client as JSON, None for 404."""
    try:
        return await read_json(await call(*args, _preload_content=False))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


class SlicePublisher:
    """Keeps the node's ResourceSlice equal to its inventory."""

    def __init__(self, api: client.ApiClient, node: str, unit: MemoryUnit) -> None:
        self.resource = client.ResourceV1Api(api)
        self.core = client.CoreV1Api(api)
        self.node = node
        self.unit = unit
        self.node_uid = ""
        self.generation = 0
        self.writes = 0
        self.gate = False  # the node's pool is gated (`gpushare.io/dra-gate=ledger`), as last read

    async def publish(self, gpus: list[GpuInfo], *, driver_version: str = "", cuda_version: str = "") -> bool:
        """Write the slice when it differs from the inventory (True when written). Raises ApiException."""
        node = await _read(self.core.read_node, self.node)
        meta = (node or {}).get("metadata") or {}
        self.node_uid = str(meta.get("uid") or self.node_uid)
        self.gate = gated(meta.get("labels"))
        name = slice_name(self.node)

        def spec_at(generation: int) -> dict[str, Any]:
            return slice_spec(
                self.node,
                gpus,
                self.unit,
                generation=generation,
                driver_version=driver_version,
                cuda_version=cuda_version,
                gate=self.gate,
            )

        for _ in range(5):
            current = await _read(self.resource.read_resource_slice, name)
            generation, changed = next_generation(current, spec_at(0)["devices"])
            self.generation = generation
            if not changed:
                return False
            spec = spec_at(generation)
            body = resource_slice(self.node, self.node_uid, spec)
            try:
                if current is None:
                    await self.resource.create_resource_slice(body, _preload_content=False)
                else:
                    body["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
                    await self.resource.replace_resource_slice(name, body, _preload_content=False)
            except ApiException as exc:
                if exc.status in (409, 404):  # written or deleted meanwhile: read again
                    continue
                raise
            self.writes += 1
            log.info(
                "published ResourceSlice %s (pool generation %d, %d GPU(s)%s)",
                name,
                generation,
                len(spec["devices"]),
                ", the ledger's binding conditions on each" if self.gate else "",
                extra={"node": self.node, "generation": generation, "gate": self.gate},
            )
            return True
        raise RuntimeError(f"ResourceSlice {name} kept changing while it was written")


class DraNode:
    """The DRA side of one node agent."""

    def __init__(
        self,
        agent: Any,
        api: client.ApiClient,
        *,
        registration_dir: Path,
        plugin_dir: Path,
        cdi_dir: Path,
        republish_s: float = 60.0,
    ) -> None:
        self.agent = agent
        self.api = api
        self.republish_s = republish_s
        node = agent.config.node
        core = client.CoreV1Api(api)
        resource = client.ResourceV1Api(api)
        self.preparer = ClaimPreparer(
            agent,
            read_claim_object=lambda ns, name: _read(resource.read_namespaced_resource_claim, name, ns),
            read_pod=lambda ns, name: _read(core.read_namespaced_pod, name, ns),
            cdi_dir=cdi_dir,
        )
        self.server = DraPluginServer(
            node,
            self.preparer,
            registration_dir=registration_dir,
            plugin_dir=plugin_dir,
            health=lambda: device_health(agent.gpus, agent.health),
            changed=agent.changed,
        )
        self.slices = SlicePublisher(api, node, agent.config.unit)
        self.published = asyncio.Event()

    async def start(self) -> None:
        """Serve kubelet (registration and the plugin)."""
        await self.server.start()

    async def close(self) -> None:
        """Stop serving kubelet (the slice stays: a restarted agent takes it over)."""
        await self.server.stop()

    async def slice_loop(self, stop: asyncio.Event) -> None:
        """Publish the slice once the ledger holds the inventory and kubelet registered the plugin, then at every
        device change (and now and then, to repair a slice edited by hand); an API error is retried with capped
        backoff."""
        attempt = 0
        waiting_since: float | None = None
        warned = False
        registered = self.server.kubelet_registered
        while not stop.is_set():
            changed = self.agent.changed()
            pause = self.republish_s
            if self.agent.inventory_recorded() and not registered.is_set():
                now = time.monotonic()
                if waiting_since is None:
                    waiting_since = now
                    log.info(
                        "the ledger holds the GPUs; the ResourceSlice waits for kubelet to register the DRA plugin",
                        extra={"node": self.agent.config.node},
                    )
                elif now - waiting_since > REGISTRATION_PATIENCE_S and not warned:
                    warned = True
                    log.warning(
                        "kubelet has not registered the DRA plugin after %.0fs, so no ResourceSlice is published: "
                        "is %s kubelet's plugins_registry (--dra-registration-dir)?%s",
                        REGISTRATION_PATIENCE_S,
                        self.server.registration_dir,
                        f" kubelet's last answer: {self.server.registration_error}"
                        if self.server.registration_error
                        else "",
                        extra={"node": self.agent.config.node},
                    )
                pause = 0.5
            elif self.agent.inventory_recorded():
                try:
                    await self.slices.publish(
                        self.agent.gpu_infos(), driver_version=self.agent.driver, cuda_version=self.agent.cuda
                    )
                    self.published.set()
                    attempt = 0
                except SliceError as exc:
                    log.error("cannot publish the ResourceSlice: %s", exc, extra={"node": self.agent.config.node})
                except (ApiException, OSError, TimeoutError, RuntimeError) as exc:
                    attempt += 1
                    pause = min(30.0, 0.5 * 2**attempt)
                    log.warning("ResourceSlice not published (%s); retrying in %.0fs", exc, pause)
            else:
                pause = 0.5
            wakers = (changed, stop) if registered.is_set() else (changed, stop, registered)
            waiters = [asyncio.create_task(e.wait()) for e in wakers]
            try:
                await asyncio.wait(waiters, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
