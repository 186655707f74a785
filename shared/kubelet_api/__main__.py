"""`python -m shared.kubelet_api [--force] [--check]`: compile the kubelet `.proto` files into this checkout
(idempotent; needs grpcio-tools, in the `dev` extra). `--check` then verifies that every generated module runs
with the grpcio and protobuf installed here (exit 1 naming each one that needs newer)."""

from __future__ import annotations

import sys

from shared.kubelet_api import PROTOS
from shared.kubelet_api.build import compile_protos, runtime_mismatches


def main(argv: list[str]) -> int:
    """Compile; print what was done; with --check, refuse generated modules the installed runtime cannot load."""
    done = compile_protos(force="--force" in argv)
    print(f"compiled: {', '.join(done)}" if done else f"up to date: {', '.join(PROTOS)}")
    if "--check" in argv:
        problems = runtime_mismatches()
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if problems:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
