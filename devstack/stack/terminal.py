"""A terminal that may go away: `gpushare up`'s output must never stop it from stopping.

`make run 2>&1 | tee run.log` and Ctrl-C: the terminal's SIGINT reaches `tee` too, so by the time `gpushare up`
prints "stopping everything" its stdout is a pipe nobody reads, and a plain `print` raises BrokenPipeError (a
terminal that hung up gives EIO). Before, that exception left the finally block before the services were
stopped. `guard_terminal()` wraps stdout and stderr so that a write to a reader that is gone drops the output
(the file descriptor then points at /dev/null, so the interpreter's own flush at exit is quiet too) and never
raises: the log file keeps every line that matters.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from typing import TextIO

LOST_READER_ERRNOS = {errno.EPIPE, errno.EIO, errno.ECONNRESET, errno.ENXIO}


class ForgivingStream(io.TextIOBase):
    """A text stream whose writes never raise because its reader left; everything after that is dropped."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = False

    def _lose(self) -> None:
        """The reader is gone: point the descriptor at /dev/null so nothing written later can fail."""
        self.lost = True
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)

    def _guarded(self, action, *args):  # type: ignore[no-untyped-def]
        if self.lost:
            return None
        try:
            return action(*args)
        except OSError as exc:  # BrokenPipeError is an OSError (EPIPE)
            if exc.errno not in LOST_READER_ERRNOS and not isinstance(exc, BrokenPipeError):
                raise
            self._lose()
            return None

    def write(self, text: str) -> int:
        """Write `text`, or drop it when the reader is gone; returns its length either way."""
        self._guarded(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        """Flush, unless the reader is gone."""
        self._guarded(self._stream.flush)

    def fileno(self) -> int:
        """The underlying descriptor (subprocesses may inherit it)."""
        return self._stream.fileno()

    def isatty(self) -> bool:
        """Whether the underlying stream is a terminal (False once its reader is gone)."""
        if self.lost:
            return False
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def writable(self) -> bool:
        """Always: writes never fail."""
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The underlying stream's encoding."""
        return getattr(self._stream, "encoding", "utf-8") or "utf-8"


def guard_terminal() -> None:
    """Wrap sys.stdout and sys.stderr (idempotent) so that losing the terminal never raises from a write."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ForgivingStream):
            setattr(sys, name, ForgivingStream(stream))
