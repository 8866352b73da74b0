"""What our dependencies print, warn and log while we compile, kept off the terminal.

torchao, torch's pytree, coremltools, torchgen and cpuinfo (from C, straight to
file descriptor 2) write to the terminal on import and while converting; none of
it is about the user's model, and it buries the report. During a compile it is
captured: Python's warnings, every log record that is not ours, `print`s, and
whatever reaches file descriptors 1 and 2 from C. The lines land in the report
(each stage's `messages`); the CLI shows them with `-v`. Our own log records
still reach the handlers the caller installed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import threading
import warnings
from typing import Iterator

OUR_LOGGER = "compiler"


def _is_ours(record: logging.LogRecord) -> bool:
    return record.name == OUR_LOGGER or record.name.startswith(OUR_LOGGER + ".")


class _RouteRecords(logging.Handler):
    """Stands in for the root logger's handlers: our records go on to them, the rest is kept."""

    def __init__(self, handlers: list[logging.Handler], kept: list[str]) -> None:
        super().__init__()
        self.handlers = handlers
        self.kept = kept

    def emit(self, record: logging.LogRecord) -> None:
        if not _is_ours(record):
            self.kept.append(f"{record.levelname} {record.name}: {record.getMessage()}")
            return
        for handler in self.handlers or [logging.lastResort]:
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


class _Redirection:
    """The process-wide part: where the streams point while any capture is open. Compiles in
    several threads share one (installed by the first, restored by the last), so descriptors
    always come back to where they were; each capture reads from where it started."""

    def __init__(self) -> None:
        self.records: list[str] = []  # log records and warnings, as lines
        self.python = io.StringIO()  # sys.stdout and sys.stderr
        self.files = {fd: tempfile.TemporaryFile() for fd in (1, 2)}  # unlinked: nothing is left behind
        self._stack = contextlib.ExitStack()

    def install(self) -> None:
        stack = self._stack.__enter__()
        try:
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("default")
            self._warnings = caught
            root = logging.getLogger()
            handlers = root.handlers[:]
            root.handlers = [_RouteRecords(handlers, self.records)]
            stack.callback(setattr, root, "handlers", handlers)
            for fd, file in self.files.items():
                _flush_python_streams()
                saved = os.dup(fd)
                stack.callback(os.close, saved)
                stack.callback(os.dup2, saved, fd)
                stack.callback(_flush_python_streams)
                os.dup2(file.fileno(), fd)
            stack.callback(setattr, sys, "stdout", sys.stdout)
            stack.callback(setattr, sys, "stderr", sys.stderr)
            sys.stdout = sys.stderr = self.python
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        self._stack.__exit__(None, None, None)
        for file in self.files.values():
            file.close()

    def positions(self) -> dict[str, int]:
        self.records += [_warning_line(w) for w in self._warnings]
        self._warnings.clear()
        _flush_python_streams()
        return {
            "records": len(self.records),
            "python": len(self.python.getvalue()),
            **{str(fd): os.fstat(file.fileno()).st_size for fd, file in self.files.items()},
        }

    def since(self, start: dict[str, int], end: dict[str, int]) -> tuple[str, ...]:
        lines = self.records[start["records"]:end["records"]]
        chunks = [self.python.getvalue()[start["python"]:end["python"]]]
        for fd, file in self.files.items():
            # pread: the descriptor shares its offset with fd 1 or 2, which must keep appending.
            data = os.pread(file.fileno(), end[str(fd)] - start[str(fd)], start[str(fd)])
            chunks.append(data.decode(errors="replace"))
        for chunk in chunks:
            # A progress bar redraws its line with carriage returns: keep what it last showed.
            lines += [line.rsplit("\r", 1)[-1].rstrip() for line in chunk.splitlines()]
        return tuple(_without_repeats(line for line in lines if line.strip()))


_LOCK = threading.Lock()
_shared: _Redirection | None = None
_users = 0


class DependencyOutput:
    """A context manager: while it is open, dependencies' output is captured; `take()` returns
    the lines captured since the last `take()` (the driver takes them after each stage), and
    `leftover` holds what came after the last one once it is closed.

    It redirects process-wide state (sys.stdout/stderr, file descriptors 1 and 2, the root
    logger's handlers, the warnings filters); captures open at once in several threads share
    it, and may then each see some of the others' lines.
    """

    leftover: tuple[str, ...] = ()

    def __enter__(self) -> "DependencyOutput":
        global _shared, _users
        with _LOCK:
            if _users == 0:
                redirection = _Redirection()
                redirection.install()
                _shared = redirection
            _users += 1
            self._shared = _shared
            self._read = self._shared.positions()
        return self

    def take(self) -> tuple[str, ...]:
        with _LOCK:
            now = self._shared.positions()
            lines = self._shared.since(self._read, now)
            self._read = now
        return lines

    def __exit__(self, *exc_info) -> None:
        global _shared, _users
        self.leftover = self.take()
        with _LOCK:
            _users -= 1
            if _users == 0:
                _shared.restore()
                _shared = None


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()


def _warning_line(caught: warnings.WarningMessage) -> str:
    return f"{caught.category.__name__}: {caught.message} ({os.path.basename(caught.filename)}:{caught.lineno})"


def _without_repeats(lines) -> Iterator[str]:
    seen: set[str] = set()
    for line in lines:
        if line not in seen:
            seen.add(line)
            yield line

