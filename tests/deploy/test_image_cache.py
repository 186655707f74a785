"""The image build cache keeps what the last-used archives hold and nothing else (devstack/images/cache.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from devstack.images.cache import BuiltImage, ImageCache, input_key
from devstack.images.oci import Layer


def _image(cache: ImageCache, name: str, layers: list[bytes], when: int) -> BuiltImage:
    built = []
    for data in layers:
        digest = cache.blobs.put(data)
        layer = Layer(digest, len(data), digest, "")
        cache.remember_layer(input_key(name, data), layer)
        built.append(layer)
    key = input_key(name)
    archive = cache.archive_path(key)
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(b"tar")
    wheels = cache.wheel_dir(key)
    wheels.mkdir(parents=True)
    image = BuiltImage(name, archive, "sha256:" + "0" * 64, built, details={"wheel_dir": str(wheels)})
    cache.remember_archive(key, image)
    os.utime(archive.with_suffix(".json"), (when, when))
    return image


def test_pruning_keeps_the_archives_used_last_of_each_repository_and_what_they_hold(tmp_path: Path) -> None:
    cache = ImageCache(tmp_path)
    shared = b"base layer"
    old = _image(cache, "localhost/gpushare:0.2.0-a", [shared, b"app a"], 1_000)
    mid = _image(cache, "localhost/gpushare:0.2.0-b", [shared, b"app b"], 2_000)
    new = _image(cache, "localhost/gpushare:0.2.0-c", [shared, b"app c"], 3_000)
    other = _image(cache, "localhost/gpushare-nats:2.15.1-x", [b"nats"], 500)  # another repository: its own count
    assert cache.archive(input_key(old.name)) is not None  # a hit: `old` is now the one used last
    removed = cache.prune(keep=2)
    assert cache.archive(input_key(mid.name)) is None, "the least recently used archive goes"
    for image in (old, new, other):
        assert cache.archive(input_key(image.name)) is not None, image.name
        assert all(cache.blobs.has(layer.digest) for layer in image.layers), image.name
        assert Path(image.details["wheel_dir"]).is_dir(), image.name
    assert not cache.blobs.has(mid.layers[1].digest) and cache.blobs.has(mid.layers[0].digest)
    assert not Path(mid.details["wheel_dir"]).exists()
    assert cache.layer(input_key(mid.name, b"app b")) is None and cache.layer(input_key(old.name, shared))
    assert {p.name for p in removed} >= {mid.archive.name, mid.archive.with_suffix(".json").name}
    assert json.loads(cache.archive_path(input_key(new.name)).with_suffix(".json").read_text())["name"] == new.name
