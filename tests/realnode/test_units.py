"""The real nodes' pure parts, on any machine: their configurations, images, the choice of node kind, the demo's
printing containers, and the cleanup of a node whose owner is gone."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from devstack.cluster import images, node_cleanup
from devstack.cluster.containerd import ContainerdDirs, cni_conflist, config_toml
from devstack.cluster.kubelet import is_extended_resource_name
from devstack.cluster.node_build import NodeBinaries
from devstack.cluster.realkubelet import KubeletSettings, kubelet_config
from devstack.cluster.releases import CURRENT
from devstack.stack import realnodes
from devstack.stack.demo import demo_deployments
from devstack.stack.demo_containers import (
    container_lines,
    dra_demo_deployment,
    gpu_environment,
    ledger_record,
    not_started,
    printing_environment,
)
from tests.realnode.helpers import BEGIN, END, parse_environment


def test_each_kubelet_listens_on_loopback_only_with_what_the_machine_imposes(tmp_path: Path) -> None:
    settings = KubeletSettings(
        node="n1", root_dir=tmp_path / "k", pod_logs_dir=tmp_path / "logs", cgroup_root="/gpushare-n1-x",
        containerd_endpoint="unix:///c.sock", kubeconfig=tmp_path / "kc", client_ca=tmp_path / "ca.crt",
        port=10250, healthz_port=10248,
    )  # fmt: skip
    cfg = kubelet_config(settings)
    assert cfg["address"] == cfg["healthzBindAddress"] == "127.0.0.1" and cfg["readOnlyPort"] == 0
    assert (cfg["failCgroupV1"], cfg["cgroupDriver"], cfg["oomScoreAdj"], cfg["failSwapOn"]) == (
        False, "cgroupfs", 0, False,
    )  # fmt: skip
    assert cfg["cgroupRoot"] == "/gpushare-n1-x" and cfg["podLogsDir"] == str(tmp_path / "logs")
    assert cfg["authentication"]["anonymous"] == {"enabled": False}
    assert cfg["authentication"]["x509"] == {"clientCAFile": str(tmp_path / "ca.crt")}
    assert cfg["imageGCHighThresholdPercent"] == 100  # local images cannot be pulled again


def test_each_containerd_keeps_to_its_own_folder_and_loopback(tmp_path: Path) -> None:
    bins = NodeBinaries(*(Path(f"/b/{n}") for n in ("kubelet", "containerd", "shim", "ctr", "runc", "cni")), CURRENT)
    text = config_toml(ContainerdDirs(tmp_path / "c"), bins, images.PAUSE_IMAGE, tmp_path / "cdi")
    assert text.startswith("version = 4\n")
    for wanted in (
        "restrict_oom_score_adj = true", "SystemdCgroup = false", 'stream_server_address = "127.0.0.1"',
        "disable_tcp_service = true", "netns_mounts_under_state_dir = true", '"io.containerd.nri.v1.nri"',
        f'sandbox = "{images.PAUSE_IMAGE}"', f'cdi_spec_dirs = ["{tmp_path / "cdi"}"]',
    ):  # fmt: skip
        assert wanted in text, wanted
    key = re.compile(r'^\s*(root|state|address|path|socket_dir|conf_dir|Root|BinaryName) = "(.*)"$')
    paths = [m.group(2) for line in text.splitlines() if (m := key.match(line))]
    assert len(paths) >= 10, paths
    assert all(p == "" or p.startswith(str(tmp_path)) or p.startswith("/b/") for p in paths), paths
    assert json.loads(cni_conflist())["plugins"] == [{"type": "gpushare-loopback"}]


def test_an_image_archive_is_an_oci_layout_whose_digests_match() -> None:
    layer = images.Layer()
    layer.file("hello", b"world\n", 0o755)
    archive = images.oci_archive("gpushare.local/x:1", layer.close(), {"Cmd": ["/hello"]}, arch="amd64")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "gpushare.local/x:1"
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    assert config["config"] == {"Cmd": ["/hello"]} and len(config["rootfs"]["diff_ids"]) == 1
    assert images.oci_archive("gpushare.local/x:1", layer.close(), {}, arch="amd64") == images.oci_archive(
        "gpushare.local/x:1", layer.close(), {}, arch="amd64"
    )  # the same inputs, the same bytes


def test_stand_ins_are_kept_when_asked_and_real_nodes_refused_with_the_reason() -> None:
    assert realnodes.choose_nodes_kind("stand-in", None, 2, print) == ("stand-in", "")
    kind, why = realnodes.choose_nodes_kind("auto", None, 2, print)
    assert kind == "stand-in" and "local control plane" in why
    with pytest.raises(realnodes.RealNodesUnavailable, match="local control plane"):
        realnodes.choose_nodes_kind("real", None, 2, print)
    with pytest.raises(ValueError, match="auto, real, stand-in"):
        realnodes.choose_nodes_kind("virtual", None, 2, print)


def test_the_demo_on_real_nodes_prints_what_it_received_and_asks_the_same() -> None:
    plain = demo_deployments()
    printing = printing_environment(plain, "gpushare.local/busybox:1")
    for before, after in zip(plain, printing, strict=True):
        (b,), (a,) = before["spec"]["template"]["spec"]["containers"], after["spec"]["template"]["spec"]["containers"]
        assert a["resources"] == b["resources"] and a["name"] == b["name"]
        assert a["image"] == "gpushare.local/busybox:1" and a["imagePullPolicy"] == "Never"
    assert dra_demo_deployment(plain, "i")["spec"]["replicas"] == 2
    log = "gpushare demo: ...\nALIYUN_COM_GPU_MEM_IDX=1\nNVIDIA_VISIBLE_DEVICES=GPU-a\nHOME=/root\n"
    assert gpu_environment(log) == {"ALIYUN_COM_GPU_MEM_IDX": "1", "NVIDIA_VISIBLE_DEVICES": "GPU-a"}
    view = {"allocation": {"state": "assigned", "node": "n1", "parts": [
        {"container": "c", "gpu_index": 1, "memory_mib": 2048, "gpu_uuid": "GPU-a"}]}}  # fmt: skip
    assert ledger_record(view) == "assigned on n1: c: GPU 1 2048 MiB (GPU-a)"
    lines = container_lines([{"pod": "p", "node": "n1", "ledger": "x", "containers": {"c": {"K": "v"}, "d": "(none)"}}])
    assert lines == ["  p on n1", "    ledger:    x", "    c got: K=v", "    d: (none)"]


def test_a_demo_container_not_started_yet_says_why_not_what_the_log_api_refused() -> None:
    """`make run` once printed "(no output: 400 Bad Request)" for a DRA pod whose claim kubelet could not prepare
    yet: it now shows the container's waiting reason and the pod's newest warning."""
    waiting = SimpleNamespace(state=SimpleNamespace(waiting=SimpleNamespace(reason="ContainerCreating")))
    warnings = [("FailedScheduling", "0/2 nodes"), ("FailedPrepareDynamicResources", "driver not registered")]
    assert not_started("c", waiting, warnings) == (
        "(not started yet: ContainerCreating; FailedPrepareDynamicResources: driver not registered)"
    )
    assert not_started("c", None, []) == "(not started yet: no container yet)"


def test_the_printed_environment_is_read_between_its_markers() -> None:
    assert parse_environment(f"{BEGIN}\nA=1\n") is None  # not complete yet
    log = f"noise\n{BEGIN}\nA=1\nB=x=y\n{END}\nlater\n{BEGIN}\nA=2\n{END}\n"
    assert parse_environment(log) == {"A": "2"}  # the last run's


def test_extended_resource_names_as_kubelet_checks_them() -> None:
    assert is_extended_resource_name("aliyun.com/gpu-mem")
    for name in ("gpu-mem", "cpu", "kubernetes.io/gpu", "requests.example.com/x", "example.com/bad name"):
        assert not is_extended_resource_name(name), name


def test_a_node_whose_owner_is_gone_is_swept_and_a_living_one_is_not(tmp_path: Path) -> None:
    parent = tmp_path / "nodes"
    orphan, owned = parent / "aaaa0000", parent / "bbbb1111"
    for folder in (orphan, owned):
        (folder / "kubelet" / "pods").mkdir(parents=True)
    node_cleanup.write_owner(owned)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (orphan / node_cleanup.OWNER_FILE).write_text(f"{dead.pid} 1\n")
    assert node_cleanup.sweep_stale(parent) == [orphan]
    assert not orphan.exists() and owned.is_dir()
    assert node_cleanup.process_start_time(os.getpid()) != ""


def test_a_sweep_never_takes_a_node_folder_being_made(tmp_path: Path) -> None:
    """Two nodes start side by side (`gpushare up` starts its nodes in threads), each sweeping stale folders first:
    a sweep that ran between another node's `mkdir` and its owner file took that node's folder (seen once: the
    second node of `make run` vanished while starting). Folders are now made, owner and all, under the lock the
    sweep holds."""
    import threading

    parent = tmp_path / "nodes"
    made: list[Path] = []
    stop = threading.Event()

    def make(n: int) -> None:
        for i in range(n):
            made.append(node_cleanup.make_node_folder(f"n{i}", parent))

    def sweep() -> None:
        while not stop.is_set():
            node_cleanup.sweep_stale(parent)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    makers = [threading.Thread(target=make, args=(40,)) for _ in range(2)]
    for t in makers:
        t.start()
    for t in makers:
        t.join()
    stop.set()
    sweeper.join()
    assert len(made) == 80 and all(f.is_dir() and node_cleanup.owner_alive(f) for f in made)
