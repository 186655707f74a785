"""`python -m devstack.images`: build (once) the images of a cluster without a registry and say where they are."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devstack.cluster.buildtools import ControlPlaneUnavailable, stderr_progress

from .gpushare_image import ROOT, build_gpushare_image
from .servers import build_nats_image, build_postgres_image

BUILDS = {
    "gpushare": lambda source: build_gpushare_image(source),
    "postgres": lambda _: build_postgres_image(),
    "nats": lambda _: build_nats_image(),
}


def main(argv: list[str] | None = None) -> int:
    """Build the images asked for (default: all), print one line each: name, archive, compressed size, seconds."""
    parser = argparse.ArgumentParser(
        prog="python -m devstack.images",
        description="Build gpushare's, PostgreSQL's and NATS' images without a container engine (root, Debian 12 "
        "apt sources), as OCI archives in ~/.cache/gpushare/images; a rerun with the same inputs builds nothing. "
        "Import one into containerd with `ctr -n k8s.io images import --local ARCHIVE`.",
    )
    parser.add_argument("images", nargs="*", metavar="IMAGE", help=f"which: {', '.join(BUILDS)} (default: all)")
    parser.add_argument(
        "--source", type=Path, default=ROOT, help="the source tree of gpushare's image (default: this one)"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.images if name not in BUILDS]
    if unknown:
        parser.error(f"no image {', '.join(unknown)}: choose from {', '.join(BUILDS)}")
    for name in args.images or list(BUILDS):
        try:
            image = BUILDS[name](args.source)
        except ControlPlaneUnavailable as exc:
            stderr_progress(f"{name}: cannot be built here: {exc.reason}")
            return 1
        seconds = sum(image.seconds.values())
        state = "cached" if image.cached else "built"
        print(f"{image.name}\t{image.archive}\t{image.layer_bytes / 2**20:.1f} MiB\t{state} in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
