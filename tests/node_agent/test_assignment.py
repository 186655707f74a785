"""Exact assignment over real gRPC with the real ledger: the admission race, multi-container and
multi-GPU pods, refusals, restarted containers."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import select

from devstack.cluster.kubelet import AdmissionError
from shared.ledger.models import gpus as gpus_table
from tests.node_agent.conftest import Harness


async def _last_event(harness: Harness, kind: str) -> dict:
    await harness.relay.flush()
    msg = await harness.bus.js.get_last_msg(harness.bus.names.stream, f"{harness.bus.names.prefix}.{kind}.>")
    return json.loads(msg.data)


async def test_same_size_pods_admitted_in_reverse_order_get_exactly_their_ledger_gpu(harness: Harness) -> None:
    first, first_id = await harness.reserve("first", [("main", [(0, 4)])])  # older reservation, GPU 0
    second, second_id = await harness.reserve("second", [("main", [(1, 4)])])  # GPU 1
    k = harness.kubelet

    env_second = (await k.admit(second))["main"]  # kubelet admits the younger pod first
    env_first = (await k.admit(first))["main"]

    state1, gpus1, assigned1 = await harness.ledger_gpus(first_id, "main")
    state2, gpus2, assigned2 = await harness.ledger_gpus(second_id, "main")
    assert (state1, state2) == ("assigned", "assigned") and assigned1 and assigned2
    assert env_second["NVIDIA_VISIBLE_DEVICES"] == gpus2[0]
    assert env_first["NVIDIA_VISIBLE_DEVICES"] == gpus1[0]
    assert {gpus1[0], gpus2[0]} == {harness.gpu(0), harness.gpu(1)}
    # the agent preferred the older pod's GPU for the first admission, so the ledger exchanged them
    assert gpus2 == [harness.gpu(0)] and gpus1 == [harness.gpu(1)]
    assert env_second["ALIYUN_COM_GPU_MEM_IDX"] == "0" and env_first["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    # kubelet's device IDs agree with the ledger (so later preferences stay consistent)
    assert {d.split("-_-")[0] for d in k.assigned(second, "main", "aliyun.com/gpu-mem")} == {gpus2[0]}
    exchanged = await _last_event(harness, "exchanged")
    assert {exchanged["first_allocation_id"], exchanged["second_allocation_id"]} == {str(first_id), str(second_id)}
    assigned = await _last_event(harness, "assigned")
    assert assigned["allocation_id"] == str(first_id) and assigned["gpu_uuids"] == gpus1


async def test_in_order_admission_needs_no_exchange(harness: Harness) -> None:
    a, a_id = await harness.reserve("a", [("main", [(0, 3)])])
    b, _b_id = await harness.reserve("b", [("main", [(1, 3)])])
    env_a = (await harness.kubelet.admit(a))["main"]
    env_b = (await harness.kubelet.admit(b))["main"]
    assert env_a["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)
    assert env_b["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(1)
    assert (await harness.ledger_gpus(a_id, "main"))[1] == [harness.gpu(0)]
    await harness.relay.flush()
    with pytest.raises(Exception):  # noqa: B017 - nats raises NotFoundError: no exchange happened
        await harness.bus.js.get_last_msg(harness.bus.names.stream, f"{harness.bus.names.prefix}.exchanged.>")


async def test_pods_admitted_in_reverse_order_on_the_same_shares_need_no_exchange(harness: Harness) -> None:
    """Two pods of the same size reserved on the same GPU are interchangeable: kubelet admitting them in reverse
    order changes nothing the ledger says, so the decisions follow kubelet and no exchange is written (before: an
    exchange per such pair, a ledger transaction and both pods' annotations rewritten for nothing)."""
    first, first_id = await harness.reserve("same-first", [("main", [(2, 3)])])
    second, second_id = await harness.reserve("same-second", [("main", [(2, 3)])])
    k = harness.kubelet
    env_second = (await k.admit(second))["main"]  # handed the devices the agent meant for same-first
    env_first = (await k.admit(first))["main"]
    for alloc in (first_id, second_id):
        state, gpus, assigned = await harness.ledger_gpus(alloc, "main")
        assert (state, gpus, assigned) == ("assigned", [harness.gpu(2)], True)
    assert env_first == env_second and env_first["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(2)
    await harness.relay.flush()
    with pytest.raises(Exception):  # noqa: B017 - nats raises NotFoundError: no exchange happened
        await harness.bus.js.get_last_msg(harness.bus.names.stream, f"{harness.bus.names.prefix}.exchanged.>")
    assigned = await _last_event(harness, "assigned")
    assert assigned["allocation_id"] == str(first_id)


async def test_multi_container_pod(harness: Harness) -> None:
    pod, alloc = await harness.reserve("multi", [("web", [(0, 2)]), ("worker", [(2, 10)]), ("side", [(0, 2)])])
    envs = await harness.kubelet.admit(pod)
    assert envs["web"]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)
    assert envs["worker"]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(2)
    assert envs["side"]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)
    assert envs["web"]["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2" and envs["worker"]["ALIYUN_COM_GPU_MEM_CONTAINER"] == "10"
    assert envs["web"]["ALIYUN_COM_GPU_MEM_POD"] == "14"
    assert envs["worker"]["ALIYUN_COM_GPU_MEM_DEV"] == "80"
    # no pod identity in the environment: Allocate cannot know the pod (see docs/node-agent.md)
    assert not {"GPUSHARE_ALLOCATION_ID", "GPUSHARE_POD_UID", "GPUSHARE_CONTAINER"} & set(envs["web"])
    assert float(envs["worker"]["GPUSHARE_GPU_MEMORY_FRACTION"]) == pytest.approx(10 / 80, abs=1e-3)
    for c in ("web", "worker", "side"):
        state, _, assigned = await harness.ledger_gpus(alloc, c)
        assert assigned and state == "assigned"


async def test_a_pods_containers_are_confirmed_together_at_its_first_prestart(harness: Harness) -> None:
    """kubelet allocates all of a pod's containers at admission, then starts them one after the other: the first
    PreStart confirms every container kubelet lists with the devices Allocate decided for it, in one request to
    the gateway (one ledger transaction); the later PreStarts find them confirmed and ask the ledger nothing."""
    pod, alloc = await harness.reserve("together", [("web", [(0, 2)]), ("worker", [(2, 10)]), ("side", [(1, 2)])])
    k, commands = harness.kubelet, harness.agent.assigner._commands
    envs = await k.admit(pod, start=False)
    before = commands.batches
    await k.restart_container(pod, "web")  # kubelet starts the first container
    assert commands.batches == before + 1
    for c, gpu in (("web", 0), ("worker", 2), ("side", 1)):
        state, gpus, assigned = await harness.ledger_gpus(alloc, c)
        assert (state, gpus, assigned) == ("assigned", [harness.gpu(gpu)], True)
        assert envs[c]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(gpu)
    await k.restart_container(pod, "worker")
    await k.restart_container(pod, "side")
    assert commands.batches == before + 1  # nothing more to record


async def test_init_container_sidecar_and_app_get_their_gpu_with_kubelets_device_reuse(harness: Harness) -> None:
    """kubelet hands a regular init container's devices on to later containers (the sidecar takes 4 of setup's
    6, the app the other 2 and 6 more) but never a sidecar's: 12 devices, as the ledger charges GPU 0."""
    pod, alloc = await harness.reserve(
        "sidecars",
        [("setup", [(0, 6)]), ("proxy", [(0, 4)]), ("main", [(0, 8)])],
        init=["setup"],
        sidecars=["proxy"],
    )
    k = harness.kubelet
    envs = await k.admit(pod)
    gpu = harness.gpu(0)
    for container, gib in (("setup", 6), ("proxy", 4), ("main", 8)):
        env = envs[container]
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu and env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(gib), env
        assert env["ALIYUN_COM_GPU_MEM_POD"] == "12", env  # what runs for the pod's life: app + sidecar
        state, gpus, assigned = await harness.ledger_gpus(alloc, container)
        assert (state, gpus, assigned) == ("assigned", [gpu], True)
    ids = {c: set(k.assigned(pod, c, "aliyun.com/gpu-mem")) for c in ("setup", "proxy", "main")}
    assert ids["proxy"] < ids["setup"] and len(ids["main"] & ids["setup"]) == 2
    assert not ids["proxy"] & ids["main"]
    assert len(set().union(*ids.values())) == 12
    async with harness.ledger.engine.connect() as conn:
        charged = (await conn.execute(select(gpus_table.c.allocated_memory_mib).where(gpus_table.c.uuid == gpu))).one()
    assert charged[0] == 12 * 1024


async def test_a_sidecar_reserved_on_another_gpu_than_the_init_container_before_it_is_refused(
    harness: Harness,
) -> None:
    """The known limit (docs/node-agent.md): kubelet hands the sidecar devices of the init container before it,
    on GPU 0, while the ledger holds the sidecar's share on GPU 1. Refused at Allocate, never mis-assigned."""
    pod, _ = await harness.reserve(
        "split", [("setup", [(0, 8)]), ("proxy", [(1, 4)]), ("main", [(0, 8)])], init=["setup"], sidecars=["proxy"]
    )
    with pytest.raises(AdmissionError) as refused:
        await harness.kubelet.admit(pod)
    assert (refused.value.container, refused.value.call) == ("proxy", "Allocate")
    assert "no container reserved on this node waits for 4 GiB on exactly these GPUs" in refused.value.message


async def test_multi_gpu_container(harness: Harness) -> None:
    pod, alloc = await harness.reserve("wide", [("train", [(0, 8), (1, 8)])])
    env = (await harness.kubelet.admit(pod))["train"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{harness.gpu(0)},{harness.gpu(1)}"
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "16"
    ids = harness.kubelet.assigned(pod, "train", "aliyun.com/gpu-mem")
    assert sorted({d.split("-_-")[0] for d in ids}) == sorted([harness.gpu(0), harness.gpu(1)])
    assert (await harness.ledger_gpus(alloc, "train"))[2]


async def test_pod_without_reservation_is_refused_clearly(harness: Harness) -> None:
    stray = {
        "metadata": {"name": "stray", "namespace": "default", "uid": "u-stray"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"aliyun.com/gpu-mem": "5"}}}]},
    }
    with pytest.raises(AdmissionError) as err:
        await harness.kubelet.admit(stray)
    assert err.value.call == "Allocate"
    assert "no container reserved on this node" in err.value.message and "5 GiB" in err.value.message
    assert harness.kubelet.assigned(stray, "main", "aliyun.com/gpu-mem") == []


async def test_prestart_refuses_a_pod_admitted_in_place_of_a_different_shape(harness: Harness) -> None:
    """kubelet gives the devices chosen for one pod to a pod whose reservation has another shape."""
    _a, a_id = await harness.reserve("shape-a", [("main", [(0, 4)])])
    b, b_id = await harness.reserve("shape-b", [("main", [(1, 2)]), ("other", [(1, 2)])])
    k = harness.kubelet
    # Allocate for pod a's shape (4 units on GPU 0) but record the devices as pod b's container
    ids = [f"{harness.gpu(0)}-_-{j}" for j in range(4)]
    plugin = k.plugins["aliyun.com/gpu-mem"]
    await plugin.stub.Allocate(
        k.dp_pb2.AllocateRequest(container_requests=[k.dp_pb2.ContainerAllocateRequest(devicesIDs=ids)])
    )
    from devstack.cluster.kubelet import Assignment

    k.pods[("default", "shape-b")] = b  # kubelet admitted pod b
    k.assignments.append(Assignment("default", "shape-b", "", "main", "aliyun.com/gpu-mem", ids))
    with pytest.raises(AdmissionError) as err:
        await k._prestart("main", plugin, ids)
    assert "no pending reservation of the same shape" in err.value.message
    assert (await harness.ledger_gpus(a_id, "main"))[0] == "bound"
    assert (await harness.ledger_gpus(b_id, "main"))[0] == "bound"


async def test_equal_shares_of_differently_shaped_pods_never_deadlock(harness: Harness) -> None:
    """Pod b (2 + 4 GiB) is admitted before pod a (2 GiB), against the agent's prediction: b's 2-unit container
    gets the devices on a's GPU. Before, PreStart refused the exchange (the pods' totals differ), and a was
    later handed b's devices and refused too: neither could ever start. Both start now, each container on the
    GPU its environment names, and the ledger records exactly that."""
    a, a_id = await harness.reserve("dl-a", [("main", [(0, 2)])])
    b, b_id = await harness.reserve("dl-b", [("main", [(1, 2)]), ("side", [(1, 4)])])
    k = harness.kubelet
    env_b = await k.admit(b, start=False)
    assert env_b["main"]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0), "kubelet took the predicted pod's devices"
    await k.start_pod(b)
    env_a = (await k.admit(a))["main"]
    _, gpus_a, assigned_a = await harness.ledger_gpus(a_id, "main")
    _, gpus_b, assigned_b = await harness.ledger_gpus(b_id, "main")
    assert assigned_a and assigned_b
    assert gpus_b == [harness.gpu(0)] == [env_b["main"]["NVIDIA_VISIBLE_DEVICES"]]
    assert gpus_a == [harness.gpu(1)] == [env_a["NVIDIA_VISIBLE_DEVICES"]]
    assert (await harness.ledger_gpus(b_id, "side"))[1] == [harness.gpu(1)], "the other container stays"


async def test_restarted_container_prestarts_again_idempotently(harness: Harness) -> None:
    pod, alloc = await harness.reserve("restarts", [("main", [(2, 20)])])
    env = (await harness.kubelet.admit(pod))["main"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(2)
    await harness.kubelet.restart_container(pod, "main")
    await harness.kubelet.restart_container(pod, "main")
    state, gpus, assigned = await harness.ledger_gpus(alloc, "main")
    assert state == "assigned" and gpus == [harness.gpu(2)] and assigned


async def test_mps_env(harness: Harness) -> None:
    harness.agent.assigner.mps = True
    pod, _ = await harness.reserve("mps", [("main", [(2, 20)])])
    env = (await harness.kubelet.admit(pod))["main"]
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


async def test_interleaved_admissions_prestart_after_both_allocates(harness: Harness) -> None:
    """kubelet admits both pods (Allocate) before starting either (PreStart), in reverse order."""
    first, first_id = await harness.reserve("i-first", [("main", [(0, 5)])])
    second, second_id = await harness.reserve("i-second", [("main", [(1, 5)])])
    k = harness.kubelet
    env_second = (await k.admit(second, start=False))["main"]
    env_first = (await k.admit(first, start=False))["main"]
    await k.start_pod(second)
    await k.start_pod(first)
    _, gpus1, assigned1 = await harness.ledger_gpus(first_id, "main")
    _, gpus2, assigned2 = await harness.ledger_gpus(second_id, "main")
    assert assigned1 and assigned2
    assert env_first["NVIDIA_VISIBLE_DEVICES"] == gpus1[0]
    assert env_second["NVIDIA_VISIBLE_DEVICES"] == gpus2[0]
    assert gpus1 != gpus2


async def test_concurrent_prestarts_of_pods_admitted_in_reverse_order_exchange_once(harness: Harness) -> None:
    """kubelet starts each admitted pod in a worker of its own (`podWorkers`), so the PreStartContainer calls of
    two pods admitted against the agent's prediction arrive together. Each finds the other pod holding its device
    set; one exchange corrects both. Before: both exchanged, the second swapping the shares back, and each
    container's environment named the other pod's GPU in the ledger."""
    first, first_id = await harness.reserve("c-first", [("main", [(0, 5)])])
    second, second_id = await harness.reserve("c-second", [("main", [(1, 5)])])
    k = harness.kubelet
    env_second = (await k.admit(second, start=False))["main"]  # handed GPU 0, the older pod's reservation
    env_first = (await k.admit(first, start=False))["main"]
    await asyncio.gather(k.start_pod(second), k.start_pod(first))
    _, gpus1, assigned1 = await harness.ledger_gpus(first_id, "main")
    _, gpus2, assigned2 = await harness.ledger_gpus(second_id, "main")
    assert assigned1 and assigned2
    assert env_second["NVIDIA_VISIBLE_DEVICES"] == gpus2[0] == harness.gpu(0)
    assert env_first["NVIDIA_VISIBLE_DEVICES"] == gpus1[0] == harness.gpu(1)


async def test_agent_restart_between_allocate_and_prestart_still_exact(harness: Harness) -> None:
    """The agent forgets its Allocate decision; PreStart recovers who got what from pod-resources + ledger."""
    first, first_id = await harness.reserve("r-first", [("main", [(0, 6)])])
    second, second_id = await harness.reserve("r-second", [("main", [(1, 6)])])
    k = harness.kubelet
    env_second = (await k.admit(second, start=False))["main"]  # handed GPU 0 (first's reservation)
    async with harness.restarted_agent():
        await k.start_pod(second)
        env_first = (await k.admit(first))["main"]
    _, gpus1, assigned1 = await harness.ledger_gpus(first_id, "main")
    _, gpus2, assigned2 = await harness.ledger_gpus(second_id, "main")
    assert assigned1 and assigned2
    assert env_second["NVIDIA_VISIBLE_DEVICES"] == gpus2[0] == harness.gpu(0)
    assert env_first["NVIDIA_VISIBLE_DEVICES"] == gpus1[0] == harness.gpu(1)


async def test_a_container_whose_first_device_set_was_dropped_gets_another(harness: Harness) -> None:
    """kubelet dropped a device set (the pod's admission failed after Allocate) and admits the pod again."""
    pod, alloc = await harness.reserve("dropped", [("main", [(1, 4)])])
    k = harness.kubelet
    plugin = k.plugins["aliyun.com/gpu-mem"]
    first = [f"{harness.gpu(1)}-_-{j}" for j in range(4, 8)]
    await plugin.stub.Allocate(
        k.dp_pb2.AllocateRequest(container_requests=[k.dp_pb2.ContainerAllocateRequest(devicesIDs=first)])
    )  # handed out, never started: kubelet forgot it
    env = (await k.admit(pod))["main"]  # before: "no container reserved ... pending container sizes: none"
    assert env["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(1)
    state, gpus, assigned = await harness.ledger_gpus(alloc, "main")
    assert state == "assigned" and assigned and gpus == [harness.gpu(1)]
    # a started container is never handed a second device set
    with pytest.raises(AdmissionError) as err:
        await k.admit({**pod, "metadata": {**pod["metadata"], "name": "dropped-copy", "uid": "u-copy"}})
    assert err.value.call == "Allocate" and "no container reserved on this node" in err.value.message


async def test_prestart_reloads_a_view_that_lags_the_holders_reservation(harness: Harness, database_url: str) -> None:
    """kubelet hands the first pod's devices to a second pod whose `reserved` event has not reached the agent
    yet (held in the outbox here: a session holds the relays' lock). PreStart reloads the view from the ledger
    and exchanges, instead of refusing the container (before: refused, CI saw it as a flaky admission test)."""
    import asyncpg

    from shared.ledger.outbox import RELAY_LOCK_KEY

    first, first_id = await harness.reserve("lag-first", [("main", [(0, 5)])])  # the agent's view has it
    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", RELAY_LOCK_KEY)  # no relay publishes from here on
        second, second_id = await harness.reserve("lag-second", [("main", [(1, 5)])], wait_for_view=False)
        assert not any(c.pod_name == "lag-second" for c in harness.agent.view.containers())
        k = harness.kubelet
        env_second = (await k.admit(second))["main"]  # Allocate picks lag-first's GPU 0: the view knows no other
        _, gpus2, assigned2 = await harness.ledger_gpus(second_id, "main")
        assert assigned2 and env_second["NVIDIA_VISIBLE_DEVICES"] == gpus2[0] == harness.gpu(0)
        _, gpus1, assigned1 = await harness.ledger_gpus(first_id, "main")
        assert not assigned1 and gpus1 == [harness.gpu(1)]  # exchanged: lag-first now holds GPU 1
    finally:
        await holder.execute("SELECT pg_advisory_unlock($1)", RELAY_LOCK_KEY)
        await holder.close()
    env_first = (await k.admit(first))["main"]
    assert env_first["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(1)


async def test_admission_right_after_the_reservation_reloads_a_lagging_view(
    harness: Harness, database_url: str
) -> None:
    """The pod's `reserved` event has not reached the agent when kubelet admits it (held in the outbox: a session
    holds the relays' lock). GetPreferredAllocation reloads the view, so kubelet picks the reserved GPUs and
    Allocate matches (before: no preference, kubelet picked other devices, and Allocate refused the pod)."""
    import asyncpg

    from shared.ledger.outbox import RELAY_LOCK_KEY

    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", RELAY_LOCK_KEY)  # no relay publishes from here on
        pod, alloc_id = await harness.reserve("early", [("main", [(1, 3)])], wait_for_view=False)
        assert not any(c.pod_name == "early" for c in harness.agent.view.containers())
        env = (await harness.kubelet.admit(pod))["main"]
    finally:
        await holder.execute("SELECT pg_advisory_unlock($1)", RELAY_LOCK_KEY)
        await holder.close()
    _, gpus, assigned = await harness.ledger_gpus(alloc_id, "main")
    assert assigned and gpus == [harness.gpu(1)] and env["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(1)


async def test_a_pod_admitted_before_its_reservation_reached_the_agent_never_takes_an_allocated_container(
    harness: Harness, database_url: str
) -> None:
    """kubelet allocated one pod and admits a second whose `reserved` event has not reached the agent (held in the
    outbox). The first pod's container holds a device set that was not started yet; the agent must read the
    ledger rather than hand that container a second set (the fallback for device sets kubelet dropped). Before:
    both sets were decided for the first pod's container, the second pod's PreStart then exchanged it, and the
    first pod's environment named a GPU the ledger gave the second."""
    import asyncpg

    from shared.ledger.outbox import RELAY_LOCK_KEY

    first, first_id = await harness.reserve("held-first", [("main", [(0, 3)])])
    k = harness.kubelet
    env_first = (await k.admit(first, start=False))["main"]
    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", RELAY_LOCK_KEY)  # no relay publishes from here on
        second, second_id = await harness.reserve("held-second", [("main", [(1, 3)])], wait_for_view=False)
        env_second = (await k.admit(second, start=False))["main"]
    finally:
        await holder.execute("SELECT pg_advisory_unlock($1)", RELAY_LOCK_KEY)
        await holder.close()
    await k.start_pod(second)
    await k.start_pod(first)
    _, gpus1, assigned1 = await harness.ledger_gpus(first_id, "main")
    _, gpus2, assigned2 = await harness.ledger_gpus(second_id, "main")
    assert assigned1 and assigned2
    assert env_first["NVIDIA_VISIBLE_DEVICES"] == gpus1[0] == harness.gpu(0)
    assert env_second["NVIDIA_VISIBLE_DEVICES"] == gpus2[0] == harness.gpu(1)
