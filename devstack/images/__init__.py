"""Container images built without a container engine or a registry: gpushare's (the Dockerfile's promises kept),
PostgreSQL's and NATS', each an OCI image layout archive for `ctr images import` (oci.py writes them).

    python -m devstack.images            # build (once) every image and print name, archive, size
"""

from .cache import BuiltImage, ImageCache
from .gpushare_image import build_gpushare_image

__all__ = ["BuiltImage", "ImageCache", "build_gpushare_image"]
