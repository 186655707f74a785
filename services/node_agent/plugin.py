"""kubelet device plugin servers (`v1beta1`): one gRPC server per resource on a unix socket.

Each server registers with `kubelet.sock` once it serves, and re-registers when kubelet restarts
(kubelet deletes every socket in the directory and recreates its own): `PluginServer.watch` notices
its socket vanished or `kubelet.sock` changed, serves again and registers again.

kubelet answers Register only after it dialled the plugin's socket (`server.Register` -> `connectClient` in
pkg/kubelet/cm/devicemanager/plugin/v1beta1, k8s.io/kubernetes v1.37.2), which it tries for up to 10 s (`dial` in
client.go): a Register may take that long, and an error it returns is kubelet refusing the registration (an
unsupported version, a bad resource name, or an endpoint it cannot reach), which the agent logs as such, naming the
resource and kubelet's reason, and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import grpc

from services.node_agent.assignment import AssignmentError, device_list
from services.node_agent.mps import client_mounts
from shared.kubelet_api import KUBELET_SOCKET, load

dp_pb2, dp_grpc = load("deviceplugin")
log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
REGISTER_TIMEOUT_S = 30.0  # kubelet dials the plugin for up to 10 s before it answers Register


def registration_problem(resource: str, exc: BaseException, plugin_dir: Path) -> tuple[int, str]:
    """(log level, message) for a failed registration: kubelet's refusal (an error it returned: gRPC UNKNOWN)
    names kubelet's reason, with what to check when kubelet could not reach the plugin's socket; anything else is
    kubelet not reachable (yet) (pure)."""
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNKNOWN:
        reason = exc.details() or "no reason given"
        hint = ""
        if "dial" in reason:
            hint = (
                f" (kubelet could not reach the plugin's socket in its own device-plugin folder: is {plugin_dir} "
                "that folder as kubelet sees it, /var/lib/kubelet/device-plugins?)"
            )
        return logging.ERROR, f"kubelet refused to register {resource}: {reason}{hint}"
    if isinstance(exc, grpc.aio.AioRpcError):
        detail = f"{exc.code().name} {exc.details() or ''}".strip()
    else:
        detail = str(exc)
    return logging.WARNING, f"cannot register {resource} with kubelet yet: {detail}"


class DeviceHandler(Protocol):
    """What the plugin asks the agent (one object serves all three resources)."""

    def device_list(self, resource: str) -> list[Any]:
        """Current `Device` messages of a resource."""
        ...

    def changed(self) -> asyncio.Event:
        """An event set at the next device change."""
        ...

    async def preferred(self, resource: str, available: list[str], must: list[str], size: int) -> list[str]:
        """Device IDs to prefer (empty: no preference)."""
        ...

    async def allocate(self, resource: str, device_ids: list[str]) -> dict[str, str]:
        """Env for a container given these IDs; raises AssignmentError."""
        ...

    async def prestart(self, resource: str, device_ids: list[str]) -> None:
        """Confirm the container about to start; raises AssignmentError."""
        ...


class DevicePluginServicer(dp_grpc.DevicePluginServicer):  # type: ignore[name-defined]  # generated at build
    """The gRPC face of one resource."""

    def __init__(self, resource: str, handler: DeviceHandler, options: Any, *, device_list: str = "envvar") -> None:
        self.resource = resource
        self.handler = handler
        self.options = options
        self.device_list = device_list

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        last = None
        while True:
            changed = self.handler.changed()
            devices = self.handler.device_list(self.resource)
            snapshot = [(d.ID, d.health) for d in devices]
            if snapshot != last:
                last = snapshot
                yield dp_pb2.ListAndWatchResponse(devices=devices)
            await changed.wait()

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        responses = []
        for req in request.container_requests:
            ids = await self.handler.preferred(
                self.resource, list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size
            )
            responses.append(dp_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return dp_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: Any, context: Any) -> Any:
        responses = []
        for req in request.container_requests:
            try:
                envs = await self.handler.allocate(self.resource, list(req.devicesIDs))
            except AssignmentError as exc:
                log.error("Allocate refused: %s", exc, extra={"resource": self.resource})
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpushare: {exc}")
            mounts = [dp_pb2.Mount(host_path=h, container_path=c) for h, c in client_mounts(envs)]
            envs, devices = device_list(envs, self.device_list)
            mounts += [dp_pb2.Mount(container_path=c, host_path=h, read_only=True) for c, h in devices]
            responses.append(dp_pb2.ContainerAllocateResponse(envs=envs, mounts=mounts))
        return dp_pb2.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        try:
            await self.handler.prestart(self.resource, list(request.devicesIDs))
        except AssignmentError as exc:
            log.error("PreStartContainer refused: %s", exc, extra={"resource": self.resource})
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpushare: {exc}")
        return dp_pb2.PreStartContainerResponse()


def socket_name(resource: str) -> str:
    """Our socket's file name for a resource (`aliyun.com/gpu-mem` -> `gpushare-gpu-mem.sock`)."""
    return f"gpushare-{resource.rsplit('/', 1)[-1]}.sock"


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class PluginServer:
    """Serves one resource on `<dir>/<socket_name>` and keeps it registered with kubelet."""

    def __init__(
        self, plugin_dir: Path, resource: str, handler: DeviceHandler, *, pre_start: bool, device_list: str = "envvar"
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.resource = resource
        self.options = dp_pb2.DevicePluginOptions(pre_start_required=pre_start, get_preferred_allocation_available=True)
        self.servicer = DevicePluginServicer(resource, handler, self.options, device_list=device_list)
        self.socket = self.plugin_dir / socket_name(resource)
        self._server: grpc.aio.Server | None = None
        self._kubelet_inode: int | None = None
        self.registrations = 0

    async def start(self) -> None:
        """Serve on a fresh socket."""
        await self.stop()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        log.info("device plugin serving", extra={"resource": self.resource, "socket": str(self.socket)})

    async def register(self) -> None:
        """Register with kubelet (raises grpc errors / FileNotFoundError when kubelet is not there)."""
        kubelet = self.plugin_dir / KUBELET_SOCKET
        inode = _inode(kubelet)
        if inode is None:
            raise FileNotFoundError(f"{kubelet} does not exist (is kubelet running?)")
        async with grpc.aio.insecure_channel(f"unix://{kubelet}") as channel:
            await dp_grpc.RegistrationStub(channel).Register(
                dp_pb2.RegisterRequest(
                    version=API_VERSION, endpoint=self.socket.name, resource_name=self.resource, options=self.options
                ),
                timeout=REGISTER_TIMEOUT_S,
            )
        self._kubelet_inode = inode
        self.registrations += 1
        log.info("registered with kubelet", extra={"resource": self.resource, "count": self.registrations})

    def needs_restart(self) -> bool:
        """Our socket vanished or kubelet.sock was recreated since we registered."""
        if self._server is None or not self.socket.exists():
            return True
        return _inode(self.plugin_dir / KUBELET_SOCKET) != self._kubelet_inode

    async def watch(self, stop: asyncio.Event, poll_s: float = 0.5) -> None:
        """Keep serving and registered until `stop` is set (each distinct problem logged once)."""
        said = ""
        while not stop.is_set():
            if self.needs_restart():
                try:
                    if self._server is None or not self.socket.exists():
                        await self.start()
                    await self.register()
                    said = ""
                except (OSError, grpc.aio.AioRpcError) as exc:
                    level, message = registration_problem(self.resource, exc, self.plugin_dir)
                    if message != said:
                        log.log(level, message, extra={"resource": self.resource})
                        said = message
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
        await self.stop()

    async def stop(self) -> None:
        """Stop serving and remove the socket."""
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
