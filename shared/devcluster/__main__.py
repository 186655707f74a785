"""``python -m shared.devcluster``: build/cache the binaries and print their paths."""

from .binaries import main

raise SystemExit(main())
