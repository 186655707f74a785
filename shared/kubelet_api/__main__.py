"""`python -m shared.kubelet_api [--force]`: compile the kubelet `.proto` files into this checkout (idempotent;
needs grpcio-tools, in the `dev` extra)."""

from __future__ import annotations

import sys

from shared.kubelet_api import PROTOS
from shared.kubelet_api.build import compile_protos


def main(argv: list[str]) -> int:
    """Compile; print what was done."""
    done = compile_protos(force="--force" in argv)
    print(f"compiled: {', '.join(done)}" if done else f"up to date: {', '.join(PROTOS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
