"""``python -m devstack.cluster``: build/cache the binaries and print their paths."""

from .binaries import main

raise SystemExit(main())
