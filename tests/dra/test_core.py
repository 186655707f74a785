"""The pure DRA core: quantities, the slice a node publishes, what an allocated claim means for the ledger, the
claim status the binder writes, the CDI spec the node agent writes."""

from __future__ import annotations

from decimal import Decimal

import pytest

from shared.dra import DRIVER, REFUSED_CONDITION, RESERVED_CONDITION, UNHEALTHY_TAINT, cdi, conditions
from shared.dra.claims import (
    ClaimAllocation,
    ClaimRefused,
    Recorded,
    allocation_id,
    claim_shares,
    from_record,
    read_claim,
    requests_gpushare,
)
from shared.dra.quantity import QuantityError, mib_quantity, parse_quantity
from shared.dra.slices import (
    GATE_LABEL,
    GATE_VALUE,
    SliceError,
    device_name,
    gated,
    next_generation,
    semver,
    slice_spec,
)
from shared.ledger.rules import gpu_charges
from shared.settings import MemoryUnit
from tests.dra.objects import claim, gpu, ledger_gpus, pod, request

GIB = MemoryUnit.GIB


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 * 2**30),
        ("4096Mi", 4 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("30", 30),
        ("500m", Decimal("0.5")),
        ("1e3", 1000),
        ("2k", 2000),
        ("0", 0),
        (7, 7),
    ],
)
def test_quantities_are_read_exactly(text: object, value: object) -> None:
    assert parse_quantity(text) == Decimal(str(value))


@pytest.mark.parametrize("text", ["", "Gi", "4GB", "4 Gi", "four", "1e", True])
def test_text_that_is_not_a_quantity_is_refused_with_the_text(text: object) -> None:
    with pytest.raises(QuantityError, match=r"quantity|suffix"):
        parse_quantity(text)


def test_mib_are_written_in_the_largest_exact_binary_unit() -> None:
    assert (mib_quantity(16384), mib_quantity(1536), mib_quantity(1)) == ("16Gi", "1536Mi", "1Mi")


def test_a_device_name_is_the_uuid_as_a_dns_label() -> None:
    assert device_name("GPU-3F1C0C2E-6A8E-5D6B-9D1E-6F0D7C1B2A90") == "gpu-3f1c0c2e-6a8e-5d6b-9d1e-6f0d7c1b2a90"
    assert device_name("MIG-GPU-ab/1/2") == "mig-gpu-ab-1-2"
    assert len(device_name("GPU-" + "a" * 100)) == 63


def test_versions_become_semver_or_are_left_out() -> None:
    assert semver("12.2") == "12.2.0"
    assert semver("535.104.05") == "535.104.5"
    assert semver("550") == "550.0.0"
    assert semver("") is None and semver("n/a") is None


def test_the_slice_has_one_shared_device_per_gpu_with_policies_the_ledger_counts_with() -> None:
    gpus = [gpu("node-a", 1, 16), gpu("node-a", 0, 16)]
    spec = slice_spec("node-a", gpus, GIB, generation=3, driver_version="535.104.05", cuda_version="12.2")
    assert spec["driver"] == DRIVER and spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    first = spec["devices"][0]
    assert first["name"] == device_name(gpus[1].uuid)  # by index: the allocator takes the first that fits
    assert first["allowMultipleAllocations"] is True
    assert first["attributes"]["uuid"] == {"string": gpus[1].uuid}
    assert first["attributes"]["index"] == {"int": 0}
    assert first["attributes"]["cudaVersion"] == {"version": "12.2.0"}
    assert first["capacity"]["memory"] == {
        "value": "16Gi",
        "requestPolicy": {"default": "16Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
    }
    assert first["capacity"]["compute"]["requestPolicy"] == {
        "default": "0",
        "validRange": {"min": "0", "max": "100", "step": "1"},
    }
    # no binding condition by default: kube-scheduler binds as soon as PreBind wrote the allocation
    assert "bindingConditions" not in first and "bindingFailureConditions" not in first
    assert "taints" not in first


def test_a_gated_pools_devices_carry_the_ledgers_binding_conditions() -> None:
    assert gated({GATE_LABEL: GATE_VALUE}) and not gated({GATE_LABEL: "no"}) and not gated(None)
    spec = slice_spec("node-a", [gpu("node-a", 0), gpu("node-a", 1)], GIB, generation=1, gate=True)
    for device in spec["devices"]:
        assert device["bindingConditions"] == [RESERVED_CONDITION]
        assert device["bindingFailureConditions"] == [REFUSED_CONDITION]
    # moving a pool into the gate is a change of the slice: a new generation
    plain = slice_spec("node-a", [gpu("node-a", 0), gpu("node-a", 1)], GIB, generation=1)
    assert next_generation({"spec": plain}, spec["devices"]) == (2, True)


def test_an_unhealthy_gpu_is_tainted_and_a_gpu_below_one_unit_is_left_out() -> None:
    sick = gpu("n", 0).model_copy(update={"healthy": False})
    tiny = gpu("n", 1).model_copy(update={"memory_mib": 512, "memory_total_mib": 512})
    one = gpu("n", 2, 1)
    spec = slice_spec("n", [sick, tiny, one], GIB, generation=1)
    assert [d["name"] for d in spec["devices"]] == [device_name(sick.uuid), device_name(one.uuid)]
    assert spec["devices"][0]["taints"] == [{"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}]
    # one unit only: min + step would pass the capacity, so the range is [1Gi, 1Gi]
    assert spec["devices"][1]["capacity"]["memory"]["requestPolicy"]["validRange"] == {"min": "1Gi", "max": "1Gi"}


def test_more_gpus_than_one_tainted_slice_carries_are_refused() -> None:
    with pytest.raises(SliceError, match="at most 64"):
        slice_spec("n", [gpu("n", i) for i in range(65)], GIB, generation=1)


def test_the_generation_rises_on_every_inventory_change_only() -> None:
    spec = slice_spec("n", [gpu("n", 0)], GIB, generation=4)
    stored = {"spec": spec}
    assert next_generation(None, spec["devices"]) == (1, True)
    assert next_generation(stored, spec["devices"]) == (4, False)
    sick = slice_spec("n", [gpu("n", 0).model_copy(update={"healthy": False})], GIB, generation=4)
    assert next_generation(stored, sick["devices"]) == (5, True)
    # the API server stamps a taint's timeAdded: that is not a change
    stamped = {
        "spec": {
            **sick,
            "devices": [{**sick["devices"][0], "taints": [{**sick["devices"][0]["taints"][0], "timeAdded": "x"}]}],
        }
    }
    assert next_generation(stamped, sick["devices"]) == (4, False)


# -- claims -------------------------------------------------------------------------------------------------------
NODE = "node-a"
GPUS = [gpu(NODE, 0), gpu(NODE, 1)]


def _allocated(p, requests, results, **kw):  # type: ignore[no-untyped-def]
    name = (
        p["spec"]["resourceClaims"][0].get("resourceClaimName")
        or p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    )
    return claim(name, "default", requests, results, node=NODE, pod_uid=p["metadata"]["uid"], **kw)


def test_one_container_one_request_is_one_part_with_the_consumed_capacity() -> None:
    p = pod("p", [("main", "c-0")])
    c = _allocated(p, [request("c-0", "4Gi", "30")], [("c-0", GPUS[1], "4Gi", "30")])
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    (part,) = alloc.parts
    assert (part.container, part.gpu_uuid, part.gpu_index, part.memory_mib, part.compute) == (
        "main",
        GPUS[1].uuid,
        1,
        4096,
        30,
    )
    assert alloc.node == NODE and alloc.claim_uid == c["metadata"]["uid"]
    share = c["status"]["allocation"]["devices"]["results"][0]["shareID"]
    assert alloc.allocation_id == allocation_id(c["metadata"]["uid"], [share])
    event = alloc.event(source="t")
    assert event.kind == "claim_reserved" and event.results[0].share_id == share


def test_the_same_allocation_always_has_the_same_id_and_a_new_one_another() -> None:
    assert allocation_id("u", ["b", "a"]) == allocation_id("u", ["a", "b"])
    assert allocation_id("u", ["a", "b"]) != allocation_id("u", ["a", "c"])


def test_names_of_requests_are_read_from_the_pod_not_assumed() -> None:
    p = pod("p", [("trainer", "whatever"), ("logger", None)], claim_entry="gpus", template="t1", claim_name="p-gpus-x1")
    c = _allocated(p, [request("whatever", "2Gi")], [("whatever", GPUS[0], "2Gi", "0")])
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    assert [pt.container for pt in alloc.parts] == ["trainer"]
    assert alloc.users == {"whatever": (alloc.users["whatever"][0],)}


def test_two_containers_two_requests_and_a_count_two_request() -> None:
    p = pod("p", [("a", "r-a"), ("b", "r-b")])
    c = _allocated(
        p,
        [request("r-a", "4Gi"), request("r-b", "8Gi", count=2)],
        [("r-a", GPUS[0], "4Gi", "0"), ("r-b", GPUS[0], "8Gi", "0"), ("r-b", GPUS[1], "8Gi", "0")],
    )
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    assert sorted((pt.container, pt.gpu_index, pt.memory_mib) for pt in alloc.parts) == [
        ("a", 0, 4096),
        ("b", 0, 8192),
        ("b", 1, 8192),
    ]
    assert gpu_charges(alloc.parts) == {GPUS[0].uuid: (12288, 0), GPUS[1].uuid: (8192, 0)}


def test_init_and_sidecar_shares_are_charged_as_dra_charges_them_the_sum() -> None:
    p = pod("p", [("app", "r-app")], inits=[("setup", "r-init", False), ("proxy", "r-side", True)])
    c = _allocated(
        p,
        [request("r-init", "2Gi"), request("r-side", "1Gi"), request("r-app", "4Gi")],
        [("r-init", GPUS[0], "2Gi", "0"), ("r-side", GPUS[0], "1Gi", "0"), ("r-app", GPUS[0], "4Gi", "0")],
    )
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    init_parts = {pt.container: (pt.init, pt.sidecar) for pt in alloc.parts}
    assert init_parts == {"setup": (True, True), "proxy": (True, True), "app": (False, False)}
    # the scheduler consumed 2 + 1 + 4 GiB of the device: so does the ledger
    assert gpu_charges(alloc.parts) == {GPUS[0].uuid: (7168, 0)}


def test_a_request_shared_by_an_init_and_an_app_container_is_held_once_by_the_app_container() -> None:
    p = pod("p", [("app", "r")], inits=[("warmup", "r", False)])
    c = _allocated(p, [request("r", "4Gi")], [("r", GPUS[0], "4Gi", "0")])
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    assert [(pt.container, pt.init) for pt in alloc.parts] == [("app", False)]
    assert [u.name for u in alloc.users["r"]] == ["app", "warmup"]


def test_a_container_naming_the_claim_without_a_request_uses_its_only_request() -> None:
    p = pod("p", [("main", "")])
    c = _allocated(p, [request("gpu", "4Gi")], [("gpu", GPUS[0], "4Gi", "0")])
    assert read_claim(c, p, ledger_gpus(GPUS), GIB).parts[0].container == "main"


def _recorded(alloc: ClaimAllocation) -> Recorded:
    """The ledger's record of an allocation the binder recorded (as the node agent's view holds it)."""
    return Recorded(alloc.pod_uid, alloc.pod_name, alloc.pod_created_at, alloc.parts)


@pytest.mark.parametrize(
    ("containers", "inits", "requests", "results"),
    [
        ([("main", "c-0")], [], [request("c-0", "4Gi", "30")], [("c-0", GPUS[1], "4Gi", "30")]),
        (
            [("a", "r-a"), ("b", "r-b")],
            [],
            [request("r-a", "4Gi"), request("r-b", "8Gi", count=2)],
            [("r-a", GPUS[0], "4Gi", "0"), ("r-b", GPUS[0], "8Gi", "0"), ("r-b", GPUS[1], "8Gi", "0")],
        ),
        (
            [("app", "r-app")],
            [("setup", "r-init", False), ("proxy", "r-side", True)],
            [request("r-init", "2Gi"), request("r-side", "1Gi"), request("r-app", "4Gi")],
            [("r-init", GPUS[0], "2Gi", "0"), ("r-side", GPUS[0], "1Gi", "0"), ("r-app", GPUS[0], "4Gi", "0")],
        ),
        ([("app", "r")], [("warmup", "r", False)], [request("r", "4Gi")], [("r", GPUS[0], "4Gi", "0")]),
    ],
    ids=["one", "two-requests-and-count-two", "init-and-sidecar", "shared-request"],
)
def test_the_ledgers_record_names_the_same_holders_as_the_pod(containers, inits, requests, results) -> None:  # type: ignore[no-untyped-def]
    """What the node agent makes of a claim from the ledger's record (no pod read) is what the binder made of it from
    the pod: the same allocation, shares, holder of each request and environment inputs; only the other users of a
    request (which hold nothing in the ledger) are left out."""
    p = pod("p", containers, inits=inits)
    c = _allocated(p, requests, results)
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    node, shares = claim_shares(c, ledger_gpus(GPUS), GIB)
    got = from_record(c, shares, _recorded(alloc))
    assert got is not None and node == alloc.node
    assert (got.allocation_id, got.claim_uid, got.claim_name, got.namespace, got.node) == (
        alloc.allocation_id,
        alloc.claim_uid,
        alloc.claim_name,
        alloc.namespace,
        alloc.node,
    )
    assert (got.pod_uid, got.pod_name, got.pod_created_at, got.shares) == (
        alloc.pod_uid,
        alloc.pod_name,
        alloc.pod_created_at,
        alloc.shares,
    )
    assert {r: [(h.name, h.index, h.init) for h in hs] for r, hs in got.users.items()} == {
        r: [(hs[0].name, hs[0].index, hs[0].init)] for r, hs in alloc.users.items()
    }
    assert got.pod_memory_mib() == alloc.pod_memory_mib()


def test_a_record_that_cannot_name_the_holders_for_certain_sends_the_node_agent_to_the_pod() -> None:
    """Two containers holding alike shares of one GPU (which is whose?), a record of other parts, or a claim reserved
    for another pod than the record's: None, and the node agent reads the pod as the binder did."""
    p = pod("p", [("a", "r-a"), ("b", "r-b")])
    c = _allocated(
        p, [request("r-a", "4Gi"), request("r-b", "4Gi")], [("r-a", GPUS[0], "4Gi", "0"), ("r-b", GPUS[0], "4Gi", "0")]
    )
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    _node, shares = claim_shares(c, ledger_gpus(GPUS), GIB)
    assert from_record(c, shares, _recorded(alloc)) is None  # alike: a-or-b per share cannot be told

    p = pod("p", [("a", "r-a"), ("b", "r-b")])
    c = _allocated(
        p, [request("r-a", "4Gi"), request("r-b", "2Gi")], [("r-a", GPUS[0], "4Gi", "0"), ("r-b", GPUS[0], "2Gi", "0")]
    )
    alloc = read_claim(c, p, ledger_gpus(GPUS), GIB)
    _node, shares = claim_shares(c, ledger_gpus(GPUS), GIB)
    told = from_record(c, shares, _recorded(alloc))
    assert told is not None and {r: hs[0].name for r, hs in told.users.items()} == {"r-a": "a", "r-b": "b"}
    assert from_record(c, shares, Recorded(alloc.pod_uid, "p", None, alloc.parts[:1])) is None  # other parts
    other = Recorded("another-pod-uid", "p", None, alloc.parts)
    assert from_record(c, shares, other) is None  # reserved for another pod than the record's
    c["status"]["reservedFor"] = []
    assert from_record(c, shares, _recorded(alloc)) is None  # reserved for nobody now


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("multiple", "MultipleRequests"),
        ("unused", "UnusedRequest"),
        ("off_step", "OffStep"),
        ("too_big", "InsufficientCapacity"),
        ("unknown_device", "UnknownDevice"),
        ("no_share", "NoConsumableCapacity"),
        ("shared", "SharedClaim"),
        ("compute_fraction", "OffStep"),
    ],
)
def test_allocations_the_ledger_cannot_record_are_refused_with_a_reason(case: str, reason: str) -> None:
    p = pod("p", [("main", "r")])
    requests = [request("r", "4Gi")]
    results = [("r", GPUS[0], "4Gi", "0")]
    gpus = ledger_gpus(GPUS)
    if case == "multiple":
        p = pod("p", [("main", "")])
        requests.append(request("s", "1Gi"))
        results.append(("s", GPUS[1], "1Gi", "0"))
    elif case == "unused":
        requests.append(request("s", "1Gi"))
        results.append(("s", GPUS[1], "1Gi", "0"))
    elif case == "off_step":
        results = [("r", GPUS[0], "1536Mi", "0")]
    elif case == "too_big":
        results = [("r", GPUS[0], "20Gi", "0")]
    elif case == "unknown_device":
        gpus = ledger_gpus(GPUS[1:])
    elif case == "compute_fraction":
        results = [("r", GPUS[0], "4Gi", "500m")]
    c = _allocated(p, requests, results)
    if case == "no_share":
        del c["status"]["allocation"]["devices"]["results"][0]["shareID"]
    if case == "shared":
        c["status"]["reservedFor"].append({"resource": "pods", "name": "q", "uid": "other"})
    with pytest.raises(ClaimRefused) as refused:
        read_claim(c, p, gpus, GIB)
    assert refused.value.reason == reason
    assert refused.value.message  # a sentence for the pod's events


def test_a_claim_of_another_class_is_not_ours() -> None:
    mine = {"spec": {"devices": {"requests": [request("r")]}}}
    other = {"spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "nvidia"}}]}}}
    assert requests_gpushare(mine, "gpushare-gpu") and not requests_gpushare(other, "gpushare-gpu")


# -- conditions and CDI -------------------------------------------------------------------------------------------
def test_the_status_carries_the_verdict_per_device_and_is_read_back() -> None:
    p = pod("p", [("main", "r")])
    c = _allocated(p, [request("r")], [("r", GPUS[0], "4Gi", "0")])
    results = c["status"]["allocation"]["devices"]["results"]
    assert conditions.decided(c, results) is None
    body = conditions.status_apply(c, results, reserved=True, reason="Recorded", message="ok", data={})
    (entry,) = body["status"]["devices"]
    assert (entry["driver"], entry["pool"], entry["device"], entry["shareID"]) == (
        DRIVER,
        NODE,
        results[0]["device"],
        results[0]["shareID"],
    )
    c["status"]["devices"] = body["status"]["devices"]
    assert conditions.decided(c, results) == conditions.RESERVED
    refused = conditions.status_apply(c, results, reserved=False, reason="quota exceeded!", message="no")
    c["status"]["devices"] = refused["status"]["devices"]
    assert conditions.decided(c, results) == conditions.REFUSED
    assert refused["status"]["devices"][0]["conditions"][1]["reason"] == "Refused"  # not a valid reason: replaced


def test_the_cdi_spec_has_one_device_per_request_with_its_environment() -> None:
    spec = cdi.cdi_spec("uid-1", {"r": {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "ALIYUN_COM_GPU_MEM_IDX": "0"}})
    assert spec["kind"] == "gpushare.io/claim"
    assert cdi.device_id("uid-1", "r") == "gpushare.io/claim=uid-1-r"
    assert cdi.env_of(spec, cdi.device_name("uid-1", "r")) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-1",
        "ALIYUN_COM_GPU_MEM_IDX": "0",
    }
    assert cdi.spec_file_name("uid-1") == "gpushare.io-claim_uid-1.json"
