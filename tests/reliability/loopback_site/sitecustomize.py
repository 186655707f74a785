"""Loopback only, for an old release that cannot be told so (imported at interpreter start-up when this folder is
on PYTHONPATH; `tests/reliability/releases.py` puts it there).

Release 0.1.0's node agent has no `--host`: its metrics port listened on every address (`shared.runtime.Listen`'s
default host, "0.0.0.0"). Nothing in the test suite may listen beyond loopback, so when GPUSHARE_TEST_LISTEN_HOST
is set, that default becomes the given address before the release's code reads it.
"""

from __future__ import annotations

import dataclasses
import os

_HOST = os.environ.get("GPUSHARE_TEST_LISTEN_HOST")
if _HOST:
    from shared import runtime

    _names = [f.name for f in dataclasses.fields(runtime.Listen)]
    _defaults = list(runtime.Listen.__init__.__defaults__ or ())
    # __init__'s defaults belong to its last len(_defaults) parameters, in field order
    _defaults[_names[-len(_defaults) :].index("host")] = _HOST
    runtime.Listen.__init__.__defaults__ = tuple(_defaults)
