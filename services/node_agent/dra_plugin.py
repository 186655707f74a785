"""The node agent as a kubelet DRA plugin: registration, the `DRAPlugin` service and the device health stream.

kubelet's plugin watcher finds `<registration dir>/gpu.gpushare.io-reg.sock`, calls `GetInfo` and then
`NotifyRegistrationStatus` (pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go,
`GenerateRegisterPluginFunc`, v1.37.2). `GetInfo` answers type `DRAPlugin`, the driver name, the plugin's own
socket and the gRPC services it serves, newest first: kubelet takes the first `DRAPlugin` version it knows
(`validateSupportedServices`: `v1.DRAPlugin`, then `v1beta1.DRAPlugin`) and the newest health service the plugin
lists (`pickHealthService`: `v1.DRAResourceHealth`, then `v1alpha1`). All four are served on one socket.

`NodePrepareResources` / `NodeUnprepareResources` answer per claim UID, with an `error` for a claim that cannot be
prepared (kubelet then does not start the pod and retries); a failure of one claim never fails the others.
`NodeWatchResources` streams every GPU's health at once and again at each change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from services.node_agent.dra_prepare import ClaimPreparer, PrepareError
from shared.dra import DRIVER
from shared.dra.slices import device_name
from shared.kubelet_api import load

reg_pb2, reg_grpc = load("pluginregistration")
dra_v1, dra_v1_grpc = load("dra_v1")
dra_v1beta1, dra_v1beta1_grpc = load("dra_v1beta1")
health_v1, health_v1_grpc = load("drahealth_v1")
health_v1alpha1, health_v1alpha1_grpc = load("drahealth_v1alpha1")
log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
PLUGIN_SOCKET = "dra.sock"


def registration_socket(registration_dir: Path, driver: str = DRIVER) -> Path:
    """Where kubelet's plugin watcher finds the plugin (`<driver>-reg.sock`, the Go helper's name)."""
    return Path(registration_dir) / f"{driver}-reg.sock"


class _Registration(reg_grpc.RegistrationServicer):  # type: ignore[name-defined]  # generated at build
    def __init__(self, plugin: DraPluginServer) -> None:
        self.plugin = plugin

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.plugin.driver,
            endpoint=str(self.plugin.plugin_socket),
            supported_versions=list(SERVICES),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.plugin.registered = bool(request.plugin_registered)
        self.plugin.registration_error = request.error
        if request.plugin_registered:
            self.plugin.kubelet_registered.set()
        if request.plugin_registered:
            log.info("kubelet registered the DRA plugin %s", self.plugin.driver, extra={"driver": self.plugin.driver})
        else:
            log.error("kubelet refused the DRA plugin %s: %s", self.plugin.driver, request.error)
        self.plugin.registrations += 1
        return reg_pb2.RegistrationStatusResponse()


class _DraService:
    """`DRAPlugin` of one API version (v1 and v1beta1 differ only in `Device.share_id`)."""

    def __init__(self, plugin: DraPluginServer, pb: Any, *, share_ids: bool) -> None:
        self.plugin = plugin
        self.pb = pb
        self.share_ids = share_ids

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        async def one(claim: Any) -> tuple[str, Any]:
            try:
                devices = await self.plugin.preparer.prepare(claim.namespace, claim.uid, claim.name)
            except PrepareError as exc:
                return claim.uid, self.pb.NodePrepareResourceResponse(error=str(exc))
            except Exception as exc:  # never a crashed call: kubelet gets a reason and retries
                log.exception("preparing claim %s/%s failed", claim.namespace, claim.name)
                return claim.uid, self.pb.NodePrepareResourceResponse(error=f"internal error: {exc!r}")
            out = []
            for d in devices:
                fields: dict[str, Any] = {
                    "request_names": [d.request],
                    "pool_name": d.pool,
                    "device_name": d.device,
                    "cdi_device_ids": list(d.cdi_ids),
                }
                if self.share_ids:
                    fields["share_id"] = d.share_id
                out.append(self.pb.Device(**fields))
            return claim.uid, self.pb.NodePrepareResourceResponse(devices=out)

        answers = await asyncio.gather(*(one(c) for c in request.claims))
        return self.pb.NodePrepareResourcesResponse(claims=dict(answers))

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        claims = {}
        for claim in request.claims:
            try:
                self.plugin.preparer.unprepare(claim.uid)
                claims[claim.uid] = self.pb.NodeUnprepareResourceResponse()
            except OSError as exc:
                claims[claim.uid] = self.pb.NodeUnprepareResourceResponse(error=f"removing the CDI spec: {exc}")
        return self.pb.NodeUnprepareResourcesResponse(claims=claims)


class _Health:
    """`DRAResourceHealth.NodeWatchResources` of one API version."""

    def __init__(self, plugin: DraPluginServer, pb: Any) -> None:
        self.plugin = plugin
        self.pb = pb

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        last = None
        while True:
            changed = self.plugin.changed()
            devices = self.plugin.health()
            if devices != last:
                last = devices
                now = int(time.time())
                yield self.pb.NodeWatchResourcesResponse(
                    devices=[
                        self.pb.DeviceHealth(
                            device=self.pb.DeviceIdentifier(pool_name=self.plugin.node, device_name=name),
                            health=self.pb.HEALTHY if healthy else self.pb.UNHEALTHY,
                            last_updated_time=now,
                            message="" if healthy else "the node agent reports this GPU unhealthy",
                        )
                        for name, healthy in devices
                    ]
                )
            await changed.wait()


class DraPluginServer:
    """The plugin's two sockets: registration (in kubelet's plugins_registry) and the plugin's own."""

    def __init__(
        self,
        node: str,
        preparer: ClaimPreparer,
        *,
        registration_dir: Path,
        plugin_dir: Path,
        health: Callable[[], list[tuple[str, bool]]],
        changed: Callable[[], asyncio.Event],
        driver: str = DRIVER,
    ) -> None:
        self.node = node
        self.preparer = preparer
        self.driver = driver
        self.registration_dir = Path(registration_dir)
        self.plugin_dir = Path(plugin_dir)
        self.plugin_socket = self.plugin_dir / PLUGIN_SOCKET
        self.registration_socket = registration_socket(self.registration_dir, driver)
        self.health = health
        self.changed = changed
        self.registered = False
        self.registration_error = ""
        self.registrations = 0
        # set once kubelet registered the plugin (it stays set: a restarted kubelet registers it again)
        self.kubelet_registered = asyncio.Event()
        self._servers: list[grpc.aio.Server] = []

    async def start(self) -> None:
        """Serve the plugin socket, then the registration socket (kubelet dials the plugin once it registered)."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registration_dir.mkdir(parents=True, exist_ok=True)
        plugin = grpc.aio.server()
        dra_v1_grpc.add_DRAPluginServicer_to_server(_DraService(self, dra_v1, share_ids=True), plugin)
        dra_v1beta1_grpc.add_DRAPluginServicer_to_server(_DraService(self, dra_v1beta1, share_ids=False), plugin)
        health_v1_grpc.add_DRAResourceHealthServicer_to_server(_Health(self, health_v1), plugin)
        health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(_Health(self, health_v1alpha1), plugin)
        await self._serve(plugin, self.plugin_socket)
        registration = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), registration)
        await self._serve(registration, self.registration_socket)
        log.info(
            "DRA plugin %s serving on %s, registering at %s",
            self.driver,
            self.plugin_socket,
            self.registration_socket,
            extra={"node": self.node},
        )

    async def _serve(self, server: grpc.aio.Server, socket: Path) -> None:
        _remove(socket)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        self._servers.append(server)

    async def watch(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Serve again when a socket vanished (someone cleaned the directory): kubelet's watcher registers us anew."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            if not (self.plugin_socket.exists() and self.registration_socket.exists()):
                log.warning("a DRA plugin socket vanished; serving again", extra={"node": self.node})
                await self.stop()
                await self.start()

    async def stop(self) -> None:
        """Stop serving and remove the sockets (kubelet's watcher then unregisters the plugin)."""
        servers, self._servers = self._servers, []
        for server in servers:
            await server.stop(0)
        for socket in (self.registration_socket, self.plugin_socket):
            _remove(socket)


def _remove(socket: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        socket.unlink()


def device_health(gpus: list[Any], health: dict[str, bool]) -> list[tuple[str, bool]]:
    """(device name, healthy) of every GPU, in index order (pure)."""
    return [(device_name(g.uuid), health.get(g.uuid, True)) for g in sorted(gpus, key=lambda g: g.index)]
