"""The OCI image layouts devstack/images/oci.py writes, checked against the OCI image specification v1.1.1 (the
release containerd v2.4.2 requires, go.mod): its JSON schemas (`schema/*.json` of the Go module
github.com/opencontainers/image-spec, read from the module cache, `go mod download` fetching it when missing) and
the facts its prose states: a descriptor's digest and size are its blob's; a manifest names layers by their
compressed digest and the config by the uncompressed one (`rootfs.diff_ids`); the layout holds `oci-layout`
with `imageLayoutVersion` 1.0.0, `index.json` and `blobs/<alg>/<hex>`; containerd names the imported image by
`io.containerd.image.name` (client/import.go `imageName`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft4Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

from devstack.images.oci import (
    LAYER_MTIME,
    MEDIA_CONFIG,
    MEDIA_INDEX,
    MEDIA_LAYER_GZIP,
    MEDIA_MANIFEST,
    BlobStore,
    ImageSpec,
    read_archive,
    split_reference,
    write_archive,
    write_layer,
)
from tests.system_tools import unavailable

IMAGE_SPEC = "github.com/opencontainers/image-spec@v1.1.1"


@pytest.fixture(scope="module")
def schemas() -> Path:
    """The image specification's schema folder, from the Go module cache."""
    go = shutil.which("go")
    if go is None:
        unavailable("go is not on PATH: the OCI image specification's schemas come from its Go module")
    res = subprocess.run(
        [str(go), "mod", "download", "-json", IMAGE_SPEC], capture_output=True, text=True, timeout=300, check=False
    )
    info = json.loads(res.stdout or "{}")
    if res.returncode or not info.get("Dir"):
        unavailable(f"{IMAGE_SPEC} is not available: {info.get('Error') or res.stderr[-500:]}")
    return Path(info["Dir"]) / "schema"


def _validator(schemas: Path, name: str) -> Draft4Validator:
    """The specification's schema `name`, its references (by file name, as its Go validator loads them) resolved
    in the same folder."""

    def retrieve(uri: str) -> Resource:
        file = uri.split("#", 1)[0].rsplit("/", 1)[-1]
        return Resource.from_contents(json.loads((schemas / file).read_text()), default_specification=DRAFT4)

    schema = json.loads((schemas / name).read_text())
    return Draft4Validator(schema, registry=Registry(retrieve=retrieve))  # type: ignore[call-arg]


def _tree(root: Path) -> Path:
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tool").write_text("#!/bin/sh\necho tool\n")
    (root / "usr/bin/tool").chmod(0o755)
    (root / "usr/bin/alias").symlink_to("tool")
    (root / "etc").mkdir()
    (root / "etc/config").write_text("a = 1\n")
    os.link(root / "etc/config", root / "etc/config.copy")
    (root / "data").mkdir()
    (root / "opt/app/lib").mkdir(parents=True)
    (root / "opt/app/lib/module.py").write_text("X = 1\n")
    return root


def _members(blob: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as tar:
        return tar.getmembers()


def test_a_layer_is_a_reproducible_gzip_tar_named_by_both_digests(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    layer = write_layer(_tree(tmp_path / "a"), store, owners={"data": (999, 998)})
    blob = store.get(layer.digest)
    assert layer.digest == "sha256:" + hashlib.sha256(blob).hexdigest() and layer.size == len(blob)
    assert layer.diff_id == "sha256:" + hashlib.sha256(gzip.decompress(blob)).hexdigest()
    members = _members(blob)
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n.split("/")), "entries sorted, each folder before its contents"
    assert set(names) == {
        "data",
        "etc",
        "etc/config",
        "etc/config.copy",
        "opt",
        "opt/app",
        "opt/app/lib",
        "opt/app/lib/module.py",
        "usr",
        "usr/bin",
        "usr/bin/alias",
        "usr/bin/tool",
    }
    by_name = {m.name: m for m in members}
    assert all(m.mtime == LAYER_MTIME for m in members)
    assert {(m.uid, m.gid) for n, m in by_name.items() if n != "data"} == {(0, 0)}
    assert (by_name["data"].uid, by_name["data"].gid) == (999, 998)
    assert by_name["usr/bin/tool"].mode == 0o755 and by_name["usr/bin/tool"].isfile()
    assert by_name["usr/bin/alias"].issym() and by_name["usr/bin/alias"].linkname == "tool"
    assert by_name["etc/config"].isfile() and by_name["etc/config.copy"].islnk()
    assert by_name["etc/config.copy"].linkname == "etc/config"
    # the same files written at another time, by another owner, in another folder: the same digests
    again = _tree(tmp_path / "b")
    for path in again.rglob("*"):
        os.utime(path, (1_600_000_000, 1_600_000_000), follow_symlinks=False)
    assert write_layer(again, store, owners={"data": (999, 998)}) == layer


def test_a_layer_takes_what_include_selects_and_the_folders_above_it(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    layer = write_layer(_tree(tmp_path / "root"), store, include=lambda p: p.parts[:2] == ("opt", "app"))
    assert [m.name for m in _members(store.get(layer.digest))] == [
        "opt",
        "opt/app",
        "opt/app/lib",
        "opt/app/lib/module.py",
    ]


def _archive(tmp_path: Path) -> tuple[Path, Any, list[Any]]:
    store = BlobStore(tmp_path / "blobs")
    root = _tree(tmp_path / "root")
    lower = write_layer(root, store, include=lambda p: p.parts[0] != "opt", comment="lower")
    upper = write_layer(root, store, include=lambda p: p.parts[0] == "opt", comment="upper")
    spec = ImageSpec(
        entrypoint=("tool",),
        cmd=("--help",),
        env={"PATH": "/usr/bin", "HOME": "/tmp"},
        user="10001:10001",
        working_dir="/tmp",
        exposed_ports=("8080/tcp",),
        labels={"org.opencontainers.image.title": "t"},
        stop_signal="SIGINT",
    )
    path = tmp_path / "image.tar"
    desc = write_archive(path, "localhost/test:1.0-abc", spec, [lower, upper], store)
    return path, desc, [lower, upper]


def test_the_archive_is_an_image_layout_the_specification_validates(tmp_path: Path, schemas: Path) -> None:
    path, desc, layers = _archive(tmp_path)
    archive = read_archive(path)
    assert archive.oci_layout == {"imageLayoutVersion": "1.0.0"}
    _validator(schemas, "image-layout-schema.json").validate(archive.oci_layout)
    _validator(schemas, "image-index-schema.json").validate(archive.index)
    assert archive.index["mediaType"] == MEDIA_INDEX and archive.index["schemaVersion"] == 2
    (entry,) = archive.index["manifests"]
    assert entry["digest"] == desc.digest and entry["mediaType"] == MEDIA_MANIFEST
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    assert entry["annotations"] == {
        "io.containerd.image.name": "localhost/test:1.0-abc",
        "org.opencontainers.image.ref.name": "1.0-abc",
    }
    # every blob is stored under its own digest, and every descriptor gives the blob's digest and size
    for digest, data in archive.blobs.items():
        assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert entry["size"] == len(archive.blobs[entry["digest"]])
    manifest = archive.document(entry["digest"])
    _validator(schemas, "image-manifest-schema.json").validate(manifest)
    assert manifest["mediaType"] == MEDIA_MANIFEST and manifest["config"]["mediaType"] == MEDIA_CONFIG
    assert manifest["config"]["size"] == len(archive.blobs[manifest["config"]["digest"]])
    assert [(d["mediaType"], d["digest"], d["size"]) for d in manifest["layers"]] == [
        (MEDIA_LAYER_GZIP, layer.digest, len(archive.blobs[layer.digest])) for layer in layers
    ]
    config = archive.document(manifest["config"]["digest"])
    _validator(schemas, "config-schema.json").validate(config)
    # the config names each layer by the digest of its uncompressed tar, bottom first
    assert config["rootfs"] == {
        "type": "layers",
        "diff_ids": [
            "sha256:" + hashlib.sha256(gzip.decompress(archive.blobs[d["digest"]])).hexdigest()
            for d in manifest["layers"]
        ],
    }
    assert config["architecture"] == "amd64" and config["os"] == "linux"
    assert config["config"] == {
        "User": "10001:10001",
        "ExposedPorts": {"8080/tcp": {}},
        "Env": ["PATH=/usr/bin", "HOME=/tmp"],
        "Entrypoint": ["tool"],
        "Cmd": ["--help"],
        "WorkingDir": "/tmp",
        "Labels": {"org.opencontainers.image.title": "t"},
        "StopSignal": "SIGINT",
    }
    assert [h["created_by"] for h in config["history"]] == ["lower", "upper"]


def test_the_schemas_refuse_what_the_specification_refuses(schemas: Path, tmp_path: Path) -> None:
    """The validators bite: the checks above would catch a wrong document."""
    path, desc, _ = _archive(tmp_path)
    archive = read_archive(path)
    manifest = archive.document(desc.digest)
    broken = {**manifest, "layers": [{**manifest["layers"][0], "digest": "not a digest"}]}
    assert list(_validator(schemas, "image-manifest-schema.json").iter_errors(broken))
    assert list(_validator(schemas, "image-manifest-schema.json").iter_errors({**manifest, "schemaVersion": 1}))
    assert list(_validator(schemas, "image-layout-schema.json").iter_errors({}))
    config = archive.document(manifest["config"]["digest"])
    assert list(_validator(schemas, "config-schema.json").iter_errors({**config, "architecture": 7}))


def test_an_archive_is_reproducible_and_keeps_a_repeated_layer_once(tmp_path: Path) -> None:
    first, desc, layers = _archive(tmp_path / "1")
    second, again, _ = _archive(tmp_path / "2")
    assert desc == again and first.read_bytes() == second.read_bytes()
    store = BlobStore(tmp_path / "1" / "blobs")
    twice = write_archive(tmp_path / "twice.tar", "localhost/t:1", ImageSpec(), [layers[0], layers[0]], store)
    archive = read_archive(tmp_path / "twice.tar")
    assert len(archive.document(twice.digest)["layers"]) == 2
    assert len(archive.blobs) == 3  # config, manifest and the one layer


def test_a_name_without_a_tag_is_refused_with_what_to_write() -> None:
    assert split_reference("localhost:5000/gpushare:0.2.0") == ("localhost:5000/gpushare", "0.2.0")
    for bad in ("localhost/gpushare", "localhost:5000/gpushare", ":0.2.0"):
        with pytest.raises(ValueError, match="repository:tag"):
            split_reference(bad)


def test_a_missing_layer_blob_is_named(tmp_path: Path) -> None:
    _, _, layers = _archive(tmp_path)
    with pytest.raises(FileNotFoundError, match=layers[0].digest):
        write_archive(tmp_path / "x.tar", "localhost/t:1", ImageSpec(), layers, BlobStore(tmp_path / "empty"))
