"""The image build cache: content-addressed blobs, layers by the hash of what went into them, finished archives.

    ${GPUSHARE_CACHE_DIR:-~/.cache/gpushare}/images/
        blobs/sha256/<hex>      every layer (gzip tar), as in an image layout
        layers/<key>.json       a layer's digests, by the key of its inputs (packages, files, recipe)
        archives/<key>.tar      a finished OCI image layout archive, and <key>.json describing it
        debs/                   the Debian packages downloaded
        wheels/<key>/           the gpushare wheel built from a source tree of that content hash

A build holds `.lock` (another build of the same cache waits); a finished archive is written atomically, so a
rerun with the same inputs reads its description and builds nothing. Each new archive prunes the cache: the
`KEEP` archives of each repository used last stay (a hit counts as a use), with their layers and wheels; older
ones go, so a checkout edited all day does not fill the disk with one archive per edit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devstack.cluster.buildtools import cache_dir

from .oci import BlobStore, Layer

__all__ = ["KEEP", "BuiltImage", "ImageCache", "input_key"]

KEEP = 3  # archives of each repository kept, the ones used last


def input_key(*parts: str | bytes) -> str:
    """A hex key of the inputs `parts` (each length-prefixed, so ('ab', 'c') and ('a', 'bc') differ) (pure)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def tree_hash(root: Path, names: Iterable[str], skip: tuple[str, ...] = ()) -> str:
    """A hex hash of the files `names` (files or folders) under `root`, their paths and contents; a path with
    any of `skip`'s fragments left out."""
    h = hashlib.sha256()
    for name in sorted(names):
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root).as_posix()
            if any(s in rel for s in skip):
                continue
            data = path.read_bytes()
            h.update(f"{rel}\0{len(data)}\0{oct(path.stat().st_mode & 0o111)}\0".encode())
            h.update(data)
    return h.hexdigest()


@dataclass
class BuiltImage:
    """A finished image: its name (`repository:tag`), archive, manifest digest, and how it was made."""

    name: str
    archive: Path
    digest: str
    layers: list[Layer]
    seconds: dict[str, float] = field(default_factory=dict)  # step -> wall seconds (this run's)
    cached: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def archive_bytes(self) -> int:
        return self.archive.stat().st_size

    @property
    def layer_bytes(self) -> int:
        """The compressed size of the image (its layers' blobs)."""
        return sum(layer.size for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest,
            "layers": [layer.to_json() for layer in self.layers],
            "details": self.details,
        }


class ImageCache:
    """The image build cache folder (see the module's docstring)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_dir() / "images"
        self.blobs = BlobStore(self.root / "blobs")
        self.debs = self.root / "debs"
        self.lock = self.root / ".lock"

    def layer(self, key: str) -> Layer | None:
        """The layer built from inputs `key`, when its blob is still here."""
        path = self.root / "layers" / f"{key}.json"
        if not path.is_file():
            return None
        layer = Layer.from_json(json.loads(path.read_text()))
        return layer if self.blobs.has(layer.digest) else None

    def remember_layer(self, key: str, layer: Layer) -> None:
        path = self.root / "layers" / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(layer.to_json(), indent=1))

    def archive_path(self, key: str) -> Path:
        return self.root / "archives" / f"{key}.tar"

    def archive(self, key: str) -> BuiltImage | None:
        """The finished image of inputs `key`, when its archive and description are both here."""
        tar, meta = self.archive_path(key), self.archive_path(key).with_suffix(".json")
        if not (tar.is_file() and meta.is_file()):
            return None
        data = json.loads(meta.read_text())
        os.utime(meta)  # used now: pruning keeps the archives used last
        return BuiltImage(
            data["name"],
            tar,
            data["digest"],
            [Layer.from_json(d) for d in data["layers"]],
            cached=True,
            details=data.get("details", {}),
        )

    def remember_archive(self, key: str, image: BuiltImage) -> None:
        meta = self.archive_path(key).with_suffix(".json")
        meta.write_text(json.dumps(image.to_json(), indent=1))
        self.prune()

    def prune(self, keep: int = KEEP) -> list[Path]:
        """Remove all but the `keep` archives of each repository used last, and the layers, blobs and wheels no
        kept archive holds (call it holding the lock); returns what it removed."""
        described = sorted((self.root / "archives").glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        kept: dict[str, list[dict[str, Any]]] = {}
        removed: list[Path] = []
        for meta in described:
            data = json.loads(meta.read_text())
            repository = str(data["name"]).rsplit(":", 1)[0]
            if len(kept.setdefault(repository, [])) < keep:
                kept[repository].append(data)
                continue
            for path in (meta, meta.with_suffix(".tar")):
                path.unlink(missing_ok=True)
                removed.append(path)
        held = {layer["digest"] for images in kept.values() for image in images for layer in image["layers"]}
        wheels = {str(image.get("details", {}).get("wheel_dir", "")) for images in kept.values() for image in images}
        for entry in (self.root / "layers").glob("*.json"):
            if json.loads(entry.read_text())["digest"] not in held:
                entry.unlink()
                removed.append(entry)
        for blob in (self.root / "blobs" / "sha256").glob("*"):
            if blob.is_file() and f"sha256:{blob.name}" not in held:
                blob.unlink()
                removed.append(blob)
        for folder in (self.root / "wheels").glob("*"):
            if folder.is_dir() and str(folder) not in wheels:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        return removed

    def wheel_dir(self, key: str) -> Path:
        return self.root / "wheels" / key
