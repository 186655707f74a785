"""A kubelet that refuses the device plugin's registration is named as such, with kubelet's reason.

kubelet v1.37.2 answers Register with an error when it refuses (an unsupported version, a bad resource name, or an
endpoint it cannot dial: `server.Register` in pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go), after trying
to dial the plugin for up to 10 s (`dial` in client.go). Before, the agent gave up on Register after 10 s as well,
so it mostly saw its own deadline, and logged either as "cannot register ... yet" with a raw gRPC dump; the real-node
tier (tests/realnode/test_restarts.py) showed it. This plays a refusing kubelet over real gRPC on a unix socket.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.node_agent.plugin import REGISTER_TIMEOUT_S, PluginServer, registration_problem
from shared.annotations import RESOURCE_MEM
from shared.kubelet_api import KUBELET_SOCKET, load
from tests.waiting import eventually

dp_pb2, dp_grpc = load("deviceplugin")
KUBELET_REASON = "failed to dial device plugin: context deadline exceeded"  # kubelet's own words (client.go)


class _RefusingKubelet:
    """kubelet's Registration service refusing every request with kubelet's reason, after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.requests: list[Any] = []

    async def Register(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        await asyncio.sleep(self.delay_s)
        await context.abort(grpc.StatusCode.UNKNOWN, KUBELET_REASON)  # a Go error reaches the client as UNKNOWN


class _NoDevices:
    def changed(self) -> asyncio.Event:
        return asyncio.Event()

    def device_list(self, resource: str) -> list[Any]:
        return []


async def _serve(folder: Path, delay_s: float) -> tuple[grpc.aio.Server, _RefusingKubelet]:
    kubelet = _RefusingKubelet(delay_s)
    server = grpc.aio.server()
    dp_grpc.add_RegistrationServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{folder / KUBELET_SOCKET}")
    await server.start()
    return server, kubelet


async def test_a_refusal_is_logged_as_kubelets_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # kubelet answers only after its 10 s dial of the plugin's socket: the agent must still be waiting then
    assert REGISTER_TIMEOUT_S > 10
    server, kubelet = await _serve(tmp_path, delay_s=0.2)
    plugin = PluginServer(tmp_path, RESOURCE_MEM, _NoDevices(), pre_start=True)  # type: ignore[arg-type]
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, logger="services.node_agent.plugin")
    watching = asyncio.create_task(plugin.watch(stop, poll_s=0.05))
    try:

        def refusals() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "kubelet refused" in r.getMessage()]

        await eventually(lambda: len(kubelet.requests) >= 3, what="three registration attempts", within=10)
        (record,) = refusals()  # logged once, though it was retried
        assert record.levelno == logging.ERROR
        message = record.getMessage()
        assert message.startswith(f"kubelet refused to register {RESOURCE_MEM}: {KUBELET_REASON}"), message
        assert str(tmp_path) in message and "/var/lib/kubelet/device-plugins" in message, message
        assert "AioRpcError" not in message and not any("cannot register" in r.getMessage() for r in caplog.records)
        assert plugin.registrations == 0
    finally:
        stop.set()
        await watching
        await server.stop(0)


def test_kubelet_out_of_reach_is_a_warning_with_the_code() -> None:
    missing = FileNotFoundError("/x/kubelet.sock does not exist (is kubelet running?)")
    level, message = registration_problem(RESOURCE_MEM, missing, Path("/x"))
    assert level == logging.WARNING
    assert (
        message
        == f"cannot register {RESOURCE_MEM} with kubelet yet: /x/kubelet.sock does not exist (is kubelet running?)"
    )


async def test_the_kubelet_stand_in_refuses_as_kubelet_does(tmp_path: Path) -> None:
    """The stand-in answers Register as kubelet v1.37.2 does: an endpoint it cannot dial, an unsupported version and
    a name that is no extended resource are refused with kubelet's words, as gRPC UNKNOWN (before, it accepted an
    unreachable endpoint and refused the others as INVALID_ARGUMENT)."""
    from devstack.cluster.kubelet import KubeletStandIn

    kubelet = KubeletStandIn(tmp_path / "dp", tmp_path / "pod-resources.sock")
    kubelet.dial_timeout_s = 0.5
    await kubelet.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{tmp_path / 'dp' / KUBELET_SOCKET}") as channel:
            stub = dp_grpc.RegistrationStub(channel)
            cases = [
                (dp_pb2.RegisterRequest(version="v1beta1", endpoint="nowhere.sock", resource_name=RESOURCE_MEM),
                 KUBELET_REASON),
                (dp_pb2.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=RESOURCE_MEM),
                 'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'),
                (dp_pb2.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="gpu-mem"),
                 'the ResourceName "gpu-mem" is invalid'),
            ]  # fmt: skip
            for request, reason in cases:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Register(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNKNOWN, request
                assert refused.value.details() == reason
        assert RESOURCE_MEM not in kubelet.plugins and len(kubelet.refusals) == 3
    finally:
        await kubelet.stop()
