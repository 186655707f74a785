"""`gpushare inspect`: gpushare's layouts byte for byte (golden outputs), and the CLI against a live API."""

from __future__ import annotations

import json

import pytest

from services.accounting import inspect_cluster, inspect_view
from services.accounting.inspect_cli import render
from shared.settings import MemoryUnit

from .conftest import LiveServer, Stack, cli

GIB = 1024


def node(name: str, address: str, gpus: list[tuple[int, int, int]], pods=(), pending_gib: int = 0, unit_mib=GIB):
    """An API node: gpus as (index, total, allocated) and pods as (name, namespace, [(index, amount)]) in units."""
    gpu_list = [
        {
            "uuid": f"GPU-{name}-{i}",
            "index": i,
            "model": "Tesla-T4",
            "memory_mib": total * unit_mib,
            "allocated_memory_mib": alloc * unit_mib,
            "used_memory_mib": None,
            "healthy": True,
        }
        for i, total, alloc in gpus
    ]
    allocations = [
        {
            "pod_uid": f"uid-{pod}",
            "pod_name": pod,
            "namespace": ns,
            "parts": [{"gpu_uuid": f"GPU-{name}-{i}", "memory_mib": amount * unit_mib} for i, amount in parts],
        }
        for pod, ns, parts in pods
    ]
    return {
        "name": name,
        "address": address,
        "gpus": gpu_list,
        "allocations": allocations,
        "pending_memory_mib": pending_gib * unit_mib,
    }


def test_summary_matches_the_published_single_gpu_example() -> None:
    # From Alibaba Cloud's documentation of kubectl inspect cgpu (same code as gpushare's).
    out = inspect_view.summary([node("cn-shanghai.192.168.6.104", "192.168.6.104", [(0, 15, 0)])], "GiB")
    assert out == (
        "NAME                       IPADDRESS      GPU0(Allocated/Total)  GPU Memory(GiB)\n"
        "cn-shanghai.192.168.6.104  192.168.6.104  0/15                   0/15\n"
        "----------------------------------------------------------------------\n"
        "Allocated/Total GPU Memory In Cluster:\n"
        "0/15 (0%)  \n"
    )


def test_summary_two_nodes_two_gpus() -> None:
    nodes = [
        node("node1", "10.0.0.1", [(0, 15, 0), (1, 15, 0)]),
        node("node2", "10.0.0.2", [(0, 15, 5), (1, 15, 4)]),
    ]
    assert inspect_view.summary(nodes, "GiB") == (
        "NAME   IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(GiB)\n"
        "node1  10.0.0.1   0/15                   0/15                   0/30\n"
        "node2  10.0.0.2   5/15                   4/15                   9/30\n"
        "--------------------------------------------------\n"
        "Allocated/Total GPU Memory In Cluster:\n"
        "9/60 (15%)  \n"
    )


def test_summary_pending_column_missing_gpus_and_unknown_address() -> None:
    nodes = [
        node("a", "", [(0, 16, 2)], pending_gib=3),
        node("bb", "10.1.1.1", [(0, 16, 1), (1, 16, 16)]),
        node("empty", "10.9.9.9", []),
    ]
    assert inspect_view.summary(nodes, "GiB") == (
        "NAME  IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  PENDING(Allocated)  GPU Memory(GiB)\n"
        "a     unknown    2/16                   0/0                    3                   5/16\n"
        "bb    10.1.1.1   1/16                   16/16                                      17/32\n"
        "----------------------------------------------\n"  # len("a\tunknown\t2/16\t0/0\t3\t5/16\n") + 20
        "Allocated/Total GPU Memory In Cluster:\n"
        "22/48 (45%)  \n"
    )


def test_unit_label_says_mib_when_a_gpu_has_more_than_100_units() -> None:
    nodes = [node("n", "10.0.0.1", [(0, 15360, 1024)], unit_mib=1)]
    out = inspect_view.summary(nodes, "MiB")
    assert out.splitlines()[0].endswith("GPU Memory(MiB)")
    assert out.splitlines()[1] == "n     10.0.0.1   1024/15360             1024/15360"
    assert out.splitlines()[-1] == "1024/15360 (6%)  "


def test_details_match_the_published_example() -> None:
    # From gpushare-device-plugin's user guide: two 3 GiB pods on a 7 GiB GPU.
    nodes = [
        node(
            "node5",
            "10.202.115.1",
            [(0, 7, 6)],
            pods=[
                ("tf-jupyter-954ffbbf8-lztc9", "default", [(0, 3)]),
                ("tf-jupyter2-69b6f97566-j4f4w", "default", [(0, 3)]),
            ],
        )
    ]
    out = inspect_view.details(nodes, "GiB")
    published = """
NAME:       node5
IPADDRESS:  10.202.115.1

NAME                          NAMESPACE  GPU0(Allocated)
tf-jupyter-954ffbbf8-lztc9    default    3
tf-jupyter2-69b6f97566-j4f4w  default    3
Allocated :                   6 (85%)
Total :                       7
----------------------------------------------------------------------------------------


Allocated/Total GPU Memory In Cluster:  6/7 (85%)
"""
    assert [line.rstrip() for line in out.splitlines()] == published.splitlines()
    # Exact bytes, trailing padding included (Go's tabwriter pads tab-terminated last cells).
    assert "tf-jupyter-954ffbbf8-lztc9    default    3" + " " * 16 + "\n" in out
    assert "Total :                       7" + " " * 10 + "\n" in out


def test_details_empty_node_multi_gpu_pod_and_pending() -> None:
    nodes = [
        node("empty", "10.0.0.9", [(0, 7, 0)]),
        node(
            "busy",
            "10.0.0.8",
            [(0, 16, 6), (1, 16, 2)],
            pods=[("multi", "ml", [(0, 2), (1, 2)]), ("solo", "web", [(0, 4)])],
            pending_gib=1,
        ),
    ]
    out = inspect_view.details(nodes, "GiB")
    assert out == (
        "\n"
        "NAME:       empty\n"
        "IPADDRESS:  10.0.0.9\n"
        "\n"
        "NAME         NAMESPACE  GPU0(Allocated)  \n"
        "Allocated :  0 (0%)     \n"
        "Total :      7          \n"
        "----------\n"  # gpushare sizes every separator on the first node's pod rows (none here): 0 + 10
        "\n"
        "NAME:       busy\n"
        "IPADDRESS:  10.0.0.8\n"
        "\n"
        "NAME         NAMESPACE  GPU0(Allocated)  GPU1(Allocated)  Pending(Allocated)  \n"
        "multi        ml         2                2                0                   \n"
        "solo         web        4                0                0                   \n"
        "Allocated :  9 (28%)    \n"
        "Total :      32         \n"
        "----------\n"
        "\n"
        "\n"
        "Allocated/Total GPU Memory In Cluster:  9/39 (23%)  \n"
    )


def test_details_name_terminating_holders_below_gpushares_table() -> None:
    busy = node("busy", "10.0.0.8", [(0, 16, 6)], pods=[("leaving", "ml", [(0, 2)]), ("solo", "web", [(0, 4)])])
    busy["allocations"][0]["terminating_at"] = "2026-12-03T10:00:00+00:00"
    out = inspect_view.details([busy], "GiB")
    lines = [line.rstrip() for line in out.splitlines()]
    assert "leaving      ml         2" in lines, "gpushare's rows stay as they are"
    assert lines[lines.index("Total :      16") + 1] == "Terminating (share held until gone): ml/leaving"
    plain = inspect_view.details([node("busy", "10.0.0.8", [(0, 16, 4)], pods=[("solo", "web", [(0, 4)])])], "GiB")
    assert "Terminating" not in plain


def test_wide_and_json() -> None:
    nodes = [node("n1", "10.0.0.1", [(0, 15, 2), (1, 15, 0)])]
    nodes[0]["gpus"][0]["used_memory_mib"] = 1331
    assert (
        render(nodes, "GiB", detail=False, output="wide")
        == (
            "NAME  IPADDRESS  GPU   MODEL     UUID      ALLOCATED/TOTAL(GiB)  USED/ALLOCATED(GiB)  HEALTH\n"
            "n1    10.0.0.1   GPU0  Tesla-T4  GPU-n1-0  2/15                  1.3/2                healthy\n"
            "n1    10.0.0.1   GPU1  Tesla-T4  GPU-n1-1  0/15                  n/a                  healthy\n"
            + "-"
            * 92  # as wide as the header
            + "\n"
            "Allocated/Total GPU Memory In Cluster:  2/30 (6%)  \n"
        )
    )
    parsed = json.loads(render(nodes, "GiB", detail=False, output="json"))
    assert parsed["memory_unit"] == "GiB" and parsed["nodes"][0]["gpus"][1]["uuid"] == "GPU-n1-1"


async def test_cli_against_a_live_accounting(
    seeded: Stack, live_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--accounting-url", live_server.url]

    async def run(*args: str) -> tuple[int, str, str]:
        code = await cli("inspect", *args, *url)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = await run()
    assert code == 0
    assert (
        out
        == (
            "NAME    IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(GiB)\n"
            "node-0  unknown    2/15                   2/15                   4/30\n"
            "node-1  unknown    4/15                   4/15                   8/30\n"
            + "-"
            * 50  # len("node-0\tunknown\t2/15\t2/15\t4/30\n") + 20
            + "\nAllocated/Total GPU Memory In Cluster:\n"
            "12/60 (20%)  \n"
        )
    )
    code, out, _ = await run("-d")
    assert code == 0
    assert out == (
        "\nNAME:       node-0\nIPADDRESS:  unknown\n\n"
        "NAME         NAMESPACE  GPU0(Allocated)  GPU1(Allocated)  \n"
        "bert-1       team-a     2                0                \n"
        "bert-2       team-a     0                2                \n"
        "Allocated :  4 (13%)    \n"
        "Total :      30         \n"
        "------------------------------------------------\n"
        "\nNAME:       node-1\nIPADDRESS:  unknown\n\n"
        "NAME         NAMESPACE  GPU0(Allocated)  GPU1(Allocated)  \n"
        "train-0      team-b     4                4                \n"
        "Allocated :  8 (26%)    \n"
        "Total :      30         \n"
        "------------------------------------------------\n"
        "\n\nAllocated/Total GPU Memory In Cluster:  12/60 (20%)  \n"
    )
    code, out, _ = await run("-d", "node-1")
    assert code == 0 and "NAME:       node-1" in out and "node-0" not in out
    code, out, _ = await run("-o", "wide")
    assert code == 0 and "GPU-0-0" in out and "1.2/2" in out  # bert-1's latest sample: 1200 MiB of 2 GiB
    code, out, _ = await run("-o", "json")
    assert code == 0 and [n["name"] for n in json.loads(out)["nodes"]] == ["node-0", "node-1"]
    code, out, err = await run("ghost")
    assert code == 1 and "ghost" in err and out == ""
    code = await cli("inspect", "--accounting-url", "http://127.0.0.1:9")
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach accounting at http://127.0.0.1:9" in err and "Traceback" not in err


# ------------------------------------------------------------------- the API server alone (accounting unreachable)


def k8s_node(name: str, mem: int | None, count: int | None = None, address: str = "10.0.0.1", labels=None) -> dict:
    capacity = {"cpu": "8"}
    if mem is not None:
        capacity["aliyun.com/gpu-mem"] = str(mem)
    if count is not None:
        capacity["aliyun.com/gpu-count"] = str(count)
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "status": {"capacity": capacity, "addresses": [{"type": "InternalIP", "address": address}]},
    }


def k8s_pod(name: str, node: str, mems: list[int], annotations=None, phase: str = "Running", **meta) -> dict:
    containers = [
        {"name": f"c{i}", "resources": {"limits": {"aliyun.com/gpu-mem": str(m)}}} for i, m in enumerate(mems)
    ]
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": annotations or {}}
        | meta,
        "spec": {"nodeName": node, "containers": containers},
        "status": {"phase": phase},
    }


def record(parts: list[dict]) -> str:
    return json.dumps({"id": "00000000-0000-0000-0000-000000000001", "node": "n", "version": 1, "parts": parts})


def test_the_api_servers_view_is_gpushares_published_example() -> None:
    # gpushare-device-plugin's user guide: two 3 GiB pods on node5's 7 GiB GPU, read from the cluster alone.
    nodes = [k8s_node("node5", 7, 1, "10.202.115.1"), k8s_node("cpu-only", None)]
    idx = {"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_POD": "3"}
    pods = [
        k8s_pod("tf-jupyter-954ffbbf8-lztc9", "node5", [3], idx),
        k8s_pod("tf-jupyter2-69b6f97566-j4f4w", "node5", [3], idx),
        k8s_pod("finished", "node5", [3], idx, phase="Succeeded"),
        k8s_pod("elsewhere", "cpu-only", [3], idx),
    ]
    shown = inspect_cluster.nodes_from_cluster(nodes, pods, MemoryUnit.GIB)
    assert [n["name"] for n in shown] == ["node5"]
    out = inspect_view.details(shown, "GiB")
    assert [line.rstrip() for line in out.splitlines()][1:8] == [
        "NAME:       node5",
        "IPADDRESS:  10.202.115.1",
        "",
        "NAME                          NAMESPACE  GPU0(Allocated)",
        "tf-jupyter-954ffbbf8-lztc9    default    3",
        "tf-jupyter2-69b6f97566-j4f4w  default    3",
        "Allocated :                   6 (85%)",
    ]
    assert out.rstrip().endswith("Allocated/Total GPU Memory In Cluster:  6/7 (85%)")


def test_the_api_servers_view_reads_records_indices_and_pending_pods() -> None:
    nodes = [k8s_node("a", 32, 2, "10.0.0.1"), k8s_node("b", 15, None, "10.0.0.2")]
    parts = [
        # an init container (ends before the app starts) and a sidecar beside the app on GPU 1
        {
            "container": "init",
            "container_index": 0,
            "gpu_uuid": "GPU-1",
            "gpu_index": 1,
            "memory_mib": 5 * GIB,
            "init": True,
        },
        {
            "container": "side",
            "container_index": 1,
            "gpu_uuid": "GPU-1",
            "gpu_index": 1,
            "memory_mib": 1 * GIB,
            "init": True,
            "sidecar": True,
        },
        {"container": "main", "container_index": 0, "gpu_uuid": "GPU-1", "gpu_index": 1, "memory_mib": 2 * GIB},
        {"container": "main", "container_index": 0, "gpu_uuid": "GPU-0", "gpu_index": 0, "memory_mib": 2 * GIB},
    ]
    pods = [
        k8s_pod("recorded", "a", [4], {"gpushare.io/allocation": record(parts), "ALIYUN_COM_GPU_MEM_IDX": "0,1"}),
        k8s_pod("aliyun", "a", [4], {"ALIYUN_COM_GPU_MEM_IDX": "0"}),
        k8s_pod("spread", "a", [1], {"ALIYUN_COM_GPU_MEM_IDX": "0,1", "ALIYUN_COM_GPU_MEM_POD": "3"}),
        k8s_pod("bound-only", "b", [2]),
        k8s_pod("no-such-gpu", "b", [1], {"ALIYUN_COM_GPU_MEM_IDX": "3"}),
        k8s_pod("leaving", "b", [4], {"ALIYUN_COM_GPU_MEM_IDX": "0"}, deletionTimestamp="2026-12-03T10:00:00Z"),
        k8s_pod("no-gpu", "b", []),
        k8s_pod("unreadable", "b", [2], {"gpushare.io/allocation": "{", "ALIYUN_COM_GPU_MEM_IDX": "x"}),
    ]
    a, b = inspect_cluster.nodes_from_cluster(nodes, pods, MemoryUnit.GIB)
    # record: GPU0 2, GPU1 max(init 5, sidecar 1 + app 2) = 5; aliyun 4 on GPU0; spread 3 GiB as 1.5 + 1.5
    assert [g["allocated_memory_mib"] for g in a["gpus"]] == [2 * GIB + 4 * GIB + 1536, 5 * GIB + 1536]
    assert [g["memory_mib"] for g in a["gpus"]] == [16 * GIB, 16 * GIB] and a["pending_memory_mib"] == 0
    # b has one 15 GiB GPU (no count); pending: bound without an index, an index it lacks, an unreadable one
    assert [g["memory_mib"] for g in b["gpus"]] == [15 * GIB]
    assert b["gpus"][0]["allocated_memory_mib"] == 4 * GIB
    assert b["pending_memory_mib"] == (2 + 1 + 2) * GIB
    assert {x["pod_name"]: x["terminating_at"] for x in b["allocations"]}["leaving"] == "2026-12-03T10:00:00Z"
    assert "no-gpu" not in {x["pod_name"] for x in b["allocations"]}
    assert inspect_view.summary([a, b], "GiB").splitlines()[1:3] == [
        "a     10.0.0.1   8/16                   7/16                                       15/32",  # 7.5, 6.5 up
        "b     10.0.0.2   4/15                   0/0                    5                   9/15",
    ]
    detail = inspect_view.details([b], "GiB")
    assert "Terminating (share held until gone): default/leaving" in detail
    assert "bound-only   default    0                2" in detail
    wide = inspect_view.wide([a], "GiB").splitlines()
    assert wide[1].split() == ["a", "10.0.0.1", "GPU0", "-", "-", "8/16", "n/a", "unknown"]


def test_the_api_servers_view_in_mib() -> None:
    shown = inspect_cluster.nodes_from_cluster(
        [k8s_node("m", 30720, 2)], [k8s_pod("p", "m", [1000], {"ALIYUN_COM_GPU_MEM_IDX": "1"})], MemoryUnit.MIB
    )
    out = inspect_view.summary(shown, "MiB")
    assert out.splitlines()[0].endswith("GPU Memory(MiB)")
    assert out.splitlines()[1].split() == ["m", "10.0.0.1", "0/15360", "1000/15360", "1000/30720"]


def test_the_kubectl_plugin_says_its_name_and_gpushare_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import inspect_main
    from services.cli import main as gpushare

    with pytest.raises(SystemExit) as exit_:
        inspect_main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: kubectl inspect gpushare ")
    assert "--kubeconfig" in out and "--context" in out and "-n NAMESPACE" in out and "--database-url" not in out
    for run in (lambda: gpushare(["--version"]), lambda: inspect_main(["--version"])):
        with pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith("gpushare 0.")
    with pytest.raises(SystemExit) as exit_:
        inspect_main(["../v1/quotas"])  # never put into a URL path
    assert exit_.value.code == 2 and "'../v1/quotas' is not a Kubernetes node name" in capsys.readouterr().err


async def test_a_broken_kubeconfig_is_named_not_a_traceback(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken"
    broken.write_text("clusters: [not closed\n")
    shapeless = tmp_path / "shapeless"
    shapeless.write_text("just a string\n")
    for path, says in (
        (broken, "ParserError"),
        (shapeless, "TypeError"),
        (tmp_path / "missing", "does not exist"),
    ):
        code = await cli("inspect", "--kubeconfig", str(path))
        err = capsys.readouterr().err
        assert code == 2 and f"{path}" in err and says in err and "Traceback" not in err, err
