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


class _FileDescriptor:
    """Points a file descriptor at an unlinked temporary file, to read back what C wrote."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(fd)
        self.read_up_to = 0
        os.dup2(self.file.fileno(), fd)

    def take(self) -> str:
        self.file.seek(self.read_up_to)
        data = self.file.read()
        self.read_up_to += len(data)
        return data.decode(errors="replace")

    def restore(self) -> None:
        os.dup2(self.saved, self.fd)
        os.close(self.saved)


class DependencyOutput:
    """A context manager: while it is open, dependencies' output is captured; `take()` returns
    the lines captured since the last `take()` (the driver takes them after each stage).

    It redirects process-wide state (sys.stdout/stderr, fds 1 and 2, the root logger's
    handlers), as the driver runs one stage at a time per process.
    """

    def __init__(self) -> None:
        self._kept: list[str] = []
        self._python = io.StringIO()
        self._python_read = 0
        self._descriptors: list[_FileDescriptor] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "DependencyOutput":
        stack = self._stack.__enter__()
        try:
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("default")
            self._warnings = caught
            root = logging.getLogger()
            handlers = root.handlers[:]
            root.handlers = [_RouteRecords(handlers, self._kept)]
            stack.callback(setattr, root, "handlers", handlers)
            _flush_python_streams()
            for fd in (1, 2):
                descriptor = _FileDescriptor(fd)
                self._descriptors.append(descriptor)
                stack.callback(descriptor.restore)
                stack.callback(_flush_python_streams)
            stack.enter_context(contextlib.redirect_stdout(self._python))
            stack.enter_context(contextlib.redirect_stderr(self._python))
        except BaseException:
            self._stack.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.__exit__(*exc_info)
        self.leftover = self.take()  # what came after the last take()
        for descriptor in self._descriptors:
            descriptor.file.close()

    def take(self) -> tuple[str, ...]:
        lines = list(self._kept)
        self._kept.clear()
        lines += [_warning_line(w) for w in self._warnings]
        self._warnings.clear()
        text = self._python.getvalue()
        chunks = [text[self._python_read:]]
        self._python_read = len(text)
        _flush_python_streams()
        chunks += [d.take() for d in self._descriptors]
        for chunk in chunks:
            # A progress bar redraws its line with carriage returns: keep what it last showed.
            lines += [line.rsplit("\r", 1)[-1].rstrip() for line in chunk.splitlines()]
        return tuple(_without_repeats(line for line in lines if line.strip()))


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

