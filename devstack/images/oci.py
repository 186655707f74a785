"""OCI image layouts written without a container engine: layers, config, manifest, index, and the archive
`ctr images import` reads.

The formats are the OCI image specification's (v1.1: image-layout.md, manifest.md, config.md, layer.md): a layer
is a tar of a filesystem change set, here gzip-compressed (`application/vnd.oci.image.layer.v1.tar+gzip`); the
config names each layer by its *uncompressed* digest (`rootfs.diff_ids`), the manifest by its *compressed* one; the
image layout is a directory (here a tar of it) with `oci-layout`, `index.json` and `blobs/sha256/<hex>`. containerd
names an imported image by the index entry's `io.containerd.image.name` annotation (client/import.go, `imageName`),
else by `org.opencontainers.image.ref.name`.

Everything is reproducible: tar entries sorted, owned by root, at a fixed time; gzip without a name or time; JSON
with sorted keys. The same files give the same digests on any machine, so a build cache is keyed by content.

The pure core (`image_config`, `manifest`, `index`, `descriptor`, `canonical_json`) builds the documents; the
shells write a layer from a folder (`write_layer`) and an archive from blobs (`write_archive`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYOUT_VERSION = "1.0.0"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_CONTAINERD_NAME = "io.containerd.image.name"
# Every file in a layer has this modification time (1 January 2000): a fixed time keeps digests reproducible, and
# a time after 1980 keeps tools that reject DOS-epoch times (zip-based ones) content.
LAYER_MTIME = 946684800

__all__ = [
    "MEDIA_CONFIG",
    "MEDIA_INDEX",
    "MEDIA_LAYER_GZIP",
    "MEDIA_MANIFEST",
    "BlobStore",
    "Descriptor",
    "ImageSpec",
    "Layer",
    "canonical_json",
    "descriptor",
    "image_config",
    "index",
    "manifest",
    "read_archive",
    "store_layer",
    "write_archive",
    "write_layer",
]


def canonical_json(document: Mapping[str, Any]) -> bytes:
    """`document` as compact JSON with sorted keys: the bytes a digest is taken of (pure)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_digest(data: bytes) -> str:
    """`sha256:<hex>` of `data` (pure)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its digest and size."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    platform: Mapping[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.platform:
            out["platform"] = dict(self.platform)
        return out


def descriptor(media_type: str, data: bytes, **extra: Any) -> Descriptor:
    """The descriptor of the blob `data` (pure)."""
    return Descriptor(media_type, sha256_digest(data), len(data), **extra)


@dataclass(frozen=True)
class Layer:
    """A written layer: its blob's descriptor (compressed digest) and its diff id (uncompressed digest)."""

    digest: str
    size: int
    diff_id: str
    comment: str = ""

    def descriptor(self) -> Descriptor:
        return Descriptor(MEDIA_LAYER_GZIP, self.digest, self.size)

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size, "diff_id": self.diff_id, "comment": self.comment}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layer:
        return cls(str(data["digest"]), int(data["size"]), str(data["diff_id"]), str(data.get("comment", "")))


@dataclass(frozen=True)
class ImageSpec:
    """What a container started from the image gets (the config's `config` object, config.md)."""

    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    user: str = ""
    working_dir: str = ""
    exposed_ports: Sequence[str] = ()  # "12345/tcp"
    labels: Mapping[str, str] = field(default_factory=dict)
    stop_signal: str = ""


def image_config(spec: ImageSpec, layers: Sequence[Layer], *, architecture: str = "amd64") -> dict[str, Any]:
    """The image configuration document (config.md) of `spec` over `layers`, bottom first (pure). No `created`
    time: it is optional, and leaving it out keeps the digest a function of the content alone."""
    config: dict[str, Any] = {}
    if spec.user:
        config["User"] = spec.user
    if spec.exposed_ports:
        config["ExposedPorts"] = {port: {} for port in spec.exposed_ports}
    if spec.env:
        config["Env"] = [f"{k}={v}" for k, v in spec.env.items()]
    if spec.entrypoint:
        config["Entrypoint"] = list(spec.entrypoint)
    if spec.cmd:
        config["Cmd"] = list(spec.cmd)
    if spec.working_dir:
        config["WorkingDir"] = spec.working_dir
    if spec.labels:
        config["Labels"] = dict(spec.labels)
    if spec.stop_signal:
        config["StopSignal"] = spec.stop_signal
    return {
        "architecture": architecture,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created_by": layer.comment or "gpushare image build"} for layer in layers],
    }


def manifest(
    config: Descriptor, layers: Sequence[Layer], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The image manifest (manifest.md) of a config and its layers, bottom first (pure)."""
    out: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": config.to_json(),
        "layers": [layer.descriptor().to_json() for layer in layers],
    }
    if annotations:
        out["annotations"] = dict(annotations)
    return out


def split_reference(name: str) -> tuple[str, str]:
    """(repository, tag) of `repository:tag` (the tag after the last colon that follows the last slash) (pure)."""
    repository, sep, tag = name.rpartition(":")
    if not sep or "/" in tag or not repository:
        raise ValueError(f"image name {name!r} has no tag: write repository:tag, e.g. localhost/gpushare:0.2.0")
    return repository, tag


def index(manifest_descriptor: Descriptor, name: str, *, architecture: str = "amd64") -> dict[str, Any]:
    """The image layout's `index.json` (image-layout.md) naming one manifest `name` (`repository:tag`) (pure):
    `org.opencontainers.image.ref.name` carries the tag, as the layout specification describes it, and
    `io.containerd.image.name` the whole name containerd imports it as."""
    _, tag = split_reference(name)
    entry = Descriptor(
        MEDIA_MANIFEST,
        manifest_descriptor.digest,
        manifest_descriptor.size,
        annotations={ANNOTATION_CONTAINERD_NAME: name, ANNOTATION_REF_NAME: tag},
        platform={"architecture": architecture, "os": "linux"},
    )
    return {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [entry.to_json()]}


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `sink` (None: nowhere)."""

    def __init__(self, sink: IO[bytes] | None) -> None:
        self.sink = sink
        self.hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.hash.update(chunk)
        self.size += len(chunk)
        if self.sink is not None:
            self.sink.write(chunk)
        return len(chunk)


class BlobStore:
    """A content-addressed folder of blobs (`<root>/sha256/<hex>`), as an image layout's `blobs/` is."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64:
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.root / "sha256" / hexdigest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put(self, data: bytes) -> str:
        """Store `data`; returns its digest."""
        digest = sha256_digest(data)
        target = self.path(digest)
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(target)
        return digest

    def get(self, digest: str) -> bytes:
        return self.path(digest).read_bytes()


def _layer_entries(root: Path, include: Callable[[PurePosixPath], bool]) -> list[PurePosixPath]:
    """Paths under `root` (relative) that `include` takes, with every parent folder of each, sorted."""
    chosen: set[PurePosixPath] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = PurePosixPath(Path(dirpath).relative_to(root).as_posix())
        dirnames.sort()
        for name in [*dirnames, *filenames]:
            rel = rel_dir / name if str(rel_dir) != "." else PurePosixPath(name)
            if include(rel):
                chosen.add(rel)
                chosen.update(p for p in rel.parents if str(p) != ".")
    return sorted(chosen, key=lambda p: p.parts)


def _tarinfo(
    root: Path, rel: PurePosixPath, links: dict[tuple[int, int], str], owners: Mapping[str, tuple[int, int]]
) -> tuple[tarfile.TarInfo, Path | None]:
    path = root / rel
    st = path.lstat()
    info = tarfile.TarInfo(str(rel))
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = owners.get(str(rel), (0, 0))
    info.uname = info.gname = ""
    info.mtime = LAYER_MTIME
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        return info, None
    if stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(path)
        return info, None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: only folders, files and symbolic links go into a layer")
    if st.st_nlink > 1:
        first = links.setdefault((st.st_dev, st.st_ino), str(rel))
        if first != str(rel):
            info.type = tarfile.LNKTYPE
            info.linkname = first
            return info, None
    info.size = st.st_size
    return info, path


def write_layer(
    root: Path,
    store: BlobStore,
    *,
    include: Callable[[PurePosixPath], bool] = lambda _: True,
    comment: str = "",
    owners: Mapping[str, tuple[int, int]] | None = None,
) -> Layer:
    """The files under `root` that `include` takes (paths relative to `root`, e.g. `usr/bin/python3`), as a
    gzip-compressed layer in `store`. Every entry is root's (but the paths `owners` gives a uid and gid), at a
    fixed time, whoever owns it on disk and whenever it was written; modes are kept."""
    entries = _layer_entries(root, include)
    tmp = store.root / f".layer-{os.getpid()}.tmp"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    links: dict[tuple[int, int], str] = {}
    with tmp.open("wb") as raw:
        compressed = _Hashing(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=6) as gz:
            uncompressed = _Hashing(gz)  # type: ignore[arg-type]
            with tarfile.open(fileobj=uncompressed, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                for rel in entries:
                    info, source = _tarinfo(root, rel, links, owners or {})
                    if source is None:
                        tar.addfile(info)
                    else:
                        with source.open("rb") as fh:
                            tar.addfile(info, fh)
    layer = Layer(
        "sha256:" + compressed.hash.hexdigest(), compressed.size, "sha256:" + uncompressed.hash.hexdigest(), comment
    )
    target = store.path(layer.digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(target)
    return layer


def store_layer(tar: bytes, store: BlobStore, *, comment: str = "") -> Layer:
    """A layer from an uncompressed tar made elsewhere (in memory), gzip-compressed (no name, no time) into
    `store`."""
    compressed = gzip.compress(tar, compresslevel=6, mtime=0)
    return Layer(store.put(compressed), len(compressed), sha256_digest(tar), comment)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = LAYER_MTIME
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    info.mtime = LAYER_MTIME
    tar.addfile(info)


def write_archive(
    path: Path, name: str, spec: ImageSpec, layers: Sequence[Layer], store: BlobStore, *, architecture: str = "amd64"
) -> Descriptor:
    """An OCI image layout holding one image `name` (`repository:tag`) of `layers` (bottom first, their blobs in
    `store`), written as a tar at `path`. Returns the manifest's descriptor (its digest is the image's)."""
    config_bytes = canonical_json(image_config(spec, layers, architecture=architecture))
    config_desc = descriptor(MEDIA_CONFIG, config_bytes)
    manifest_bytes = canonical_json(manifest(config_desc, layers))
    manifest_desc = descriptor(MEDIA_MANIFEST, manifest_bytes)
    index_bytes = canonical_json(index(manifest_desc, name, architecture=architecture))
    for layer in layers:
        if not store.has(layer.digest):
            raise FileNotFoundError(f"layer blob {layer.digest} is not in {store.root}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", canonical_json({"imageLayoutVersion": LAYOUT_VERSION}))
        _add_bytes(tar, "index.json", index_bytes)
        _add_dir(tar, "blobs")
        _add_dir(tar, "blobs/sha256")
        _add_bytes(tar, "blobs/" + config_desc.digest.replace(":", "/"), config_bytes)
        _add_bytes(tar, "blobs/" + manifest_desc.digest.replace(":", "/"), manifest_bytes)
        for layer in _unique(layers):
            blob = store.path(layer.digest)
            info = tarfile.TarInfo("blobs/" + layer.digest.replace(":", "/"))
            info.size = blob.stat().st_size
            info.mode = 0o644
            info.mtime = LAYER_MTIME
            with blob.open("rb") as fh:
                tar.addfile(info, fh)
    tmp.replace(path)
    return manifest_desc


def _unique(layers: Iterable[Layer]) -> list[Layer]:
    seen: set[str] = set()
    out = []
    for layer in layers:
        if layer.digest not in seen:
            seen.add(layer.digest)
            out.append(layer)
    return out


@dataclass(frozen=True)
class Archive:
    """An image layout archive read back: its documents and blobs by digest."""

    oci_layout: dict[str, Any]
    index: dict[str, Any]
    blobs: dict[str, bytes]

    def document(self, digest: str) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.blobs[digest])
        return loaded


def read_archive(path: Path) -> Archive:
    """The documents and blobs of an image layout archive (for checks and tests)."""
    blobs: dict[str, bytes] = {}
    layout: dict[str, Any] = {}
    idx: dict[str, Any] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            fh = tar.extractfile(member)
            assert fh is not None
            data = fh.read()
            if member.name == "oci-layout":
                layout = json.loads(data)
            elif member.name == "index.json":
                idx = json.loads(data)
            elif member.name.startswith("blobs/sha256/"):
                blobs["sha256:" + member.name.rsplit("/", 1)[1]] = data
    return Archive(layout, idx, blobs)
