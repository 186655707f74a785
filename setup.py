"""Build hook (the rest of the metadata is in pyproject.toml): the kubelet gRPC modules are generated when the
package is built, so an installed gpushare never compiles anything at run time and grpcio-tools is a build
requirement only. An editable install (`pip install -e .`) writes them into the checkout instead.

The generated modules require at least the protobuf and grpcio versions of the grpcio-tools that built them;
constraints.txt pins all three together (`PIP_CONSTRAINT` reaches pip's isolated build environment too).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from shared.kubelet_api.build import compile_protos  # noqa: E402  (stdlib-only, from this source tree)


class BuildPyWithProtos(build_py):
    """`build_py`, plus the generated kubelet gRPC modules (in the build, or the checkout when editable)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            compile_protos(HERE)  # the checkout's modules, when missing or older than their .proto
        else:  # always fresh: never ship modules a checkout generated with another grpcio-tools
            compile_protos(Path(self.build_lib), force=True)


setup(cmdclass={"build_py": BuildPyWithProtos})
