"""Importing the parts of gpushare an installation may leave out (a service, the local-stack tooling)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def optional_module(name: str) -> ModuleType | None:
    """The module `name`, or None when it (or a package above it) is not installed.

    A module that is present but fails to import for another reason (a missing dependency of its own, a
    syntax error) still raises: only absence is optional.
    """
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module(name)
