"""`python -m services.node_agent.proto [--force]`: compile the kubelet `.proto` files (idempotent)."""

from __future__ import annotations

import sys

from services.node_agent.proto import PROTOS, compile_protos


def main(argv: list[str]) -> int:
    """Compile; print what was done."""
    done = compile_protos(force="--force" in argv)
    print(f"compiled: {', '.join(done)}" if done else f"up to date: {', '.join(PROTOS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
